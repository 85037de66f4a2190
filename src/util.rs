//! What every writer of mindkit shares: outputs written under a temporary name beside their
//! target and renamed into place when complete, the rules for replacing an existing output, the
//! clean-up of temporaries when the run is interrupted, and the progress bar.
//!
//! - Temporaries are named `.mindkit-<tag>-<output name>-<6 random characters>` in the output's
//!   directory, so that one left by a killed run is recognised by the next run at that output.
//! - They are created with the permissions a plain file or directory gets under the user's umask
//!   (not the 0600/0700 of a private temporary file): the output must be readable by whoever
//!   reads a normal file of that user, e.g. the training job's account.
//! - While one exists, SIGINT, SIGTERM and SIGHUP remove every live temporary and exit with the
//!   conventional status 128 + the signal's number.
//! - An output may never be, contain or lie inside an input, and `--force` replaces only what a
//!   previous output of the same kind consists of.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::fs::Permissions;
use std::io::{BufWriter, IsTerminal, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use indicatif::{ProgressBar, ProgressStyle};

/// Errors creating, checking or moving an output into place; each names the path at fault.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// An I/O failure on the named path.
    #[error("{path}: {cause}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The output exists and `--force` was not given.
    #[error("{path} already exists (pass --force to replace it)")]
    Exists {
        /// The output.
        path: PathBuf,
    },
    /// The output is one of the inputs.
    #[error("the output {output} is the input {input}: choose another output")]
    IsInput {
        /// The output as given.
        output: PathBuf,
        /// The input as given.
        input: PathBuf,
    },
    /// The output is a directory holding an input, which replacing it would delete.
    #[error(
        "the output {output} contains the input {input}: writing it would delete the input; \
         choose an output outside the input"
    )]
    ContainsInput {
        /// The output as given.
        output: PathBuf,
        /// The input as given.
        input: PathBuf,
    },
    /// The output lies inside an input directory, which it would change.
    #[error(
        "the output {output} lies inside the input {input}: choose an output outside the input"
    )]
    InsideInput {
        /// The output as given.
        output: PathBuf,
        /// The input as given.
        input: PathBuf,
    },
    /// The output exists but is a directory where a file is written, or the reverse.
    #[error("{path} exists and is not a {expected}; mindkit replaces only a previous output")]
    NotReplaceable {
        /// The output.
        path: PathBuf,
        /// "file" or "directory".
        expected: &'static str,
    },
    /// The output path names no file (`/`).
    #[error("{path} does not name a file or directory mindkit can write")]
    NoName {
        /// The output as given.
        path: PathBuf,
    },
    /// The output directory holds entries that a previous output of this kind does not.
    #[error(
        "{path} holds {entries}, which a {what} written by mindkit does not: --force replaces \
         only such a directory; move them away or choose another output"
    )]
    Foreign {
        /// The output directory.
        path: PathBuf,
        /// What is written there ("Megatron checkpoint", …).
        what: &'static str,
        /// The entries at fault, relative to `path`.
        entries: String,
    },
    /// Temporaries of an earlier, interrupted run at the same output.
    #[error(
        "an earlier run writing {output} was interrupted and left {temps}: delete them, or pass \
         --force to have them removed"
    )]
    Stale {
        /// The output.
        output: PathBuf,
        /// The temporaries.
        temps: String,
    },
    /// SIGINT/SIGTERM handling could not be set up.
    #[error("cannot watch for interruptions (to remove temporaries when stopped): {0}")]
    Signals(std::io::Error),
}

type Result<T> = std::result::Result<T, OutputError>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> OutputError + '_ {
    move |cause| OutputError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

/// An entry a previous output of some kind may hold (see [`OutputKind`]).
#[derive(Debug)]
pub enum Allowed {
    /// Files (or links) whose names match one of these glob patterns.
    Files(&'static [&'static str]),
    /// Directories whose names match the pattern, holding only what the list allows.
    Dirs(&'static str, &'static [Allowed]),
}

/// What a writer writes: how its temporaries are tagged and what `--force` may replace.
#[derive(Debug)]
pub struct OutputKind {
    /// The `<tag>` of its temporaries' names (lowercase letters only).
    pub tag: &'static str,
    /// What it is, for messages.
    pub what: &'static str,
    /// `None`: a single file. `Some(allowed)`: a directory of the allowed entries only.
    pub dir: Option<&'static [Allowed]>,
}

const TEMP_MARK: &str = ".mindkit-";
const RANDOM_CHARS: usize = 6;
/// Bytes of the output's name kept in a temporary's name (file names are at most 255 bytes).
const NAME_IN_TEMP: usize = 200;
/// What a directory moved aside while its replacement moves in is tagged.
const OLD_TAG: &str = "old";
/// Foreign entries named in an error at most.
const LISTED: usize = 10;

/// `.mindkit-<tag>-<name>-`: the start of a temporary's name for an output named `name`.
fn temp_prefix(tag: &str, name: &OsStr) -> OsString {
    let bytes = name.as_bytes();
    let mut prefix = OsString::from(format!("{TEMP_MARK}{tag}-"));
    prefix.push(OsStr::from_bytes(&bytes[..bytes.len().min(NAME_IN_TEMP)]));
    prefix.push("-");
    prefix
}

/// Whether `entry` is a temporary (of any tag) for an output named `name`.
fn is_temp_for(entry: &OsStr, name: &OsStr) -> bool {
    let Some(rest) = entry.as_bytes().strip_prefix(TEMP_MARK.as_bytes()) else {
        return false;
    };
    let Some(dash) = rest.iter().position(|&b| b == b'-') else {
        return false;
    };
    let (tag, rest) = (&rest[..dash], &rest[dash..]);
    let name = &name.as_bytes()[..name.len().min(NAME_IN_TEMP)];
    let random = rest
        .strip_prefix(b"-")
        .and_then(|r| r.strip_prefix(name))
        .and_then(|r| r.strip_prefix(b"-"));
    !tag.is_empty()
        && tag.iter().all(u8::is_ascii_lowercase)
        && random
            .is_some_and(|r| r.len() == RANDOM_CHARS && r.iter().all(u8::is_ascii_alphanumeric))
}

/// The name of the output a temporary (of any tag) named `entry` was for.
fn temp_target(entry: &OsStr) -> Option<&[u8]> {
    let rest = entry.as_bytes().strip_prefix(TEMP_MARK.as_bytes())?;
    let dash = rest.iter().position(|&b| b == b'-')?;
    let (tag, rest) = (&rest[..dash], &rest[dash + 1..]);
    let name = rest.get(..rest.len().checked_sub(RANDOM_CHARS + 1)?)?;
    let random = &rest[name.len()..];
    let fits = !tag.is_empty()
        && tag.iter().all(u8::is_ascii_lowercase)
        && !name.is_empty()
        && random[0] == b'-'
        && random[1..].iter().all(u8::is_ascii_alphanumeric);
    fits.then_some(name)
}

/// Remove the temporaries in `dir` of the outputs `is_output` names that this process is not
/// writing: those of a run killed before it could remove them (SIGKILL, a crash). Their names
/// carry no process id, so this is for a directory only one run writes at a time (a
/// checkpoint directory at a run's start). Returns what was removed.
pub fn remove_stale_temporaries(
    dir: &Path,
    is_output: impl Fn(&str) -> bool,
) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir)(e)),
    };
    let ours = live().clone();
    let mut stale: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name();
            temp_target(&name).is_some_and(|t| is_output(&String::from_utf8_lossy(t)))
        })
        .map(|e| e.path())
        .filter(|p| !ours.contains(p))
        .collect();
    stale.sort();
    for p in &stale {
        remove_entry(p).map_err(io_err(p))?;
    }
    Ok(stale)
}

/// The directory `target` is written in and its name there.
fn split_target(target: &Path) -> Result<(PathBuf, OsString)> {
    let resolved;
    let path = match target.file_name() {
        Some(_) => target,
        None => {
            resolved = resolve(target).map_err(io_err(target))?;
            &resolved
        }
    };
    let name = path.file_name().ok_or_else(|| OutputError::NoName {
        path: target.to_path_buf(),
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((dir, name.to_os_string()))
}

/// `path` made absolute with every existing part's links resolved (`canonicalize` of the
/// longest existing ancestor, the rest appended), so that two spellings of one place compare
/// equal even when the output does not exist yet.
fn resolve(path: &Path) -> std::io::Result<PathBuf> {
    let absolute = std::path::absolute(path)?;
    let parts: Vec<Component> = absolute.components().collect();
    for existing in (1..=parts.len()).rev() {
        let Ok(mut out) = parts[..existing].iter().collect::<PathBuf>().canonicalize() else {
            continue;
        };
        for part in &parts[existing..] {
            match part {
                Component::ParentDir => {
                    out.pop();
                }
                Component::Normal(n) => out.push(n),
                _ => {}
            }
        }
        return Ok(out);
    }
    Ok(absolute)
}

// ---------------------------------------------------------------------------------------------
// Live temporaries and interruption

/// Every temporary this process has created and not yet moved into place or removed.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn live() -> MutexGuard<'static, Vec<PathBuf>> {
    // A panic elsewhere while holding the list leaves it valid: every change is one push/retain.
    LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Remove a file, link or directory tree (a link, not what it points to).
fn remove_entry(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path)?.is_dir() {
        true => std::fs::remove_dir_all(path),
        false => std::fs::remove_file(path),
    }
}

/// Remove a temporary, if it is still there, on the way out.
fn remove_path(path: &Path) {
    // A writer thread may add an entry to a directory being removed: try again.
    for _ in 0..10 {
        match remove_entry(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => continue,
            _ => return,
        }
    }
}

/// Start watching SIGINT, SIGTERM and SIGHUP (once per process). On one, the watcher takes the
/// list of live temporaries and keeps it, so that no temporary is moved into place or created
/// after it looked; removes them all; and exits with status 128 + the signal's number.
/// Set by the first SIGINT/SIGTERM/SIGHUP once [`defer_signals`] was called.
static DEFERRED: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// For a long job that stops cleanly (`train --exit-signal-handler`): the first signal sets
/// the returned flag instead of ending the process, so the job can save and exit at its next
/// safe point; a second signal removes the temporaries and exits as usual.
pub fn defer_signals() -> Result<Arc<AtomicBool>> {
    let flag = DEFERRED
        .get_or_init(|| Arc::new(AtomicBool::new(false)))
        .clone();
    watch_signals()?;
    Ok(flag)
}

fn watch_signals() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    static WATCHING: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let started = WATCHING.get_or_init(|| {
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
            .map_err(|e| e.to_string())?;
        std::thread::Builder::new()
            .name("mindkit-signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    let name = signal_hook::low_level::signal_name(signal).unwrap_or("a signal");
                    if let Some(stop) = DEFERRED.get() {
                        if !stop.swap(true, std::sync::atomic::Ordering::SeqCst) {
                            eprintln!(
                                "\nmindkit: {name} received; finishing this iteration, saving and \
                                 stopping (send it again to stop at once)"
                            );
                            continue;
                        }
                    }
                    let temps = live();
                    for t in temps.iter().rev() {
                        remove_path(t);
                    }
                    // Off the progress bar's line.
                    let newline = if std::io::stderr().is_terminal() {
                        "\n"
                    } else {
                        ""
                    };
                    eprintln!(
                        "{newline}mindkit: stopped by {name}; {} temporary output(s) removed",
                        temps.len()
                    );
                    std::process::exit(128 + signal);
                }
            })
            .map(drop)
            .map_err(|e| e.to_string())
    });
    started
        .clone()
        .map_err(|e| OutputError::Signals(std::io::Error::other(e)))
}

// ---------------------------------------------------------------------------------------------
// Checking an output before any work

/// Check `target` before any work is done: it must not be, contain or lie inside any of
/// `inputs`; temporaries of an interrupted earlier run at it are an error (removed with
/// `force`); and an existing `target` needs `force` and must be a previous output of `kind`.
pub fn check_output(target: &Path, kind: &OutputKind, inputs: &[&Path], force: bool) -> Result<()> {
    check_not_input(target, inputs)?;
    check_stale(target, force)?;
    check_replaceable(target, kind, force)
}

/// Refuse an output that is, contains or lies inside one of `inputs` (compared resolved).
pub fn check_not_input(output: &Path, inputs: &[&Path]) -> Result<()> {
    let out = resolve(output).map_err(io_err(output))?;
    for &input in inputs {
        let resolved = resolve(input).map_err(io_err(input))?;
        let (output, input) = (output.to_path_buf(), input.to_path_buf());
        if out == resolved {
            return Err(OutputError::IsInput { output, input });
        } else if resolved.starts_with(&out) {
            return Err(OutputError::ContainsInput { output, input });
        } else if out.starts_with(&resolved) {
            return Err(OutputError::InsideInput { output, input });
        }
    }
    Ok(())
}

/// Temporaries an earlier run left for `target`: an error naming them, or removed with `force`.
pub fn check_stale(target: &Path, force: bool) -> Result<()> {
    let (dir, name) = split_target(target)?;
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(&dir)(e)),
    };
    let ours = live().clone();
    let mut stale: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| is_temp_for(&e.file_name(), &name))
        .map(|e| match e.path().strip_prefix(".") {
            Ok(relative) => relative.to_path_buf(),
            Err(_) => e.path(),
        })
        .filter(|p| !ours.contains(p))
        .collect();
    stale.sort();
    if stale.is_empty() {
        return Ok(());
    }
    if !force {
        return Err(OutputError::Stale {
            output: target.to_path_buf(),
            temps: list(stale.iter().map(|p| p.display().to_string())),
        });
    }
    for p in &stale {
        remove_entry(p).map_err(io_err(p))?;
    }
    Ok(())
}

/// An existing `target` needs `force`, and must be what a previous output of `kind` is.
fn check_replaceable(target: &Path, kind: &OutputKind, force: bool) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(target) else {
        return Ok(());
    };
    if !force {
        return Err(OutputError::Exists {
            path: target.to_path_buf(),
        });
    }
    let not_a = |expected| OutputError::NotReplaceable {
        path: target.to_path_buf(),
        expected,
    };
    let Some(allowed) = kind.dir else {
        return match target.is_dir() {
            true => Err(not_a("file")),
            false => Ok(()),
        };
    };
    if !meta.is_dir() {
        return Err(not_a("directory"));
    }
    let foreign = foreign_entries(target, Path::new(""), allowed)?;
    if foreign.is_empty() {
        return Ok(());
    }
    Err(OutputError::Foreign {
        path: target.to_path_buf(),
        what: kind.what,
        entries: list(foreign.into_iter()),
    })
}

/// Entries under `dir` (named relative to the output, under `rel`) that `allowed` does not allow.
fn foreign_entries(dir: &Path, rel: &Path, allowed: &[Allowed]) -> Result<Vec<String>> {
    let matches =
        |pattern: &str, name: &str| glob::Pattern::new(pattern).is_ok_and(|p| p.matches(name));
    let mut foreign = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .collect::<std::io::Result<_>>()
        .map_err(io_err(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let file_name = entry.file_name();
        let name = file_name.to_str().unwrap_or("");
        let path = entry.path();
        let is_dir = entry.file_type().map_err(io_err(&path))?.is_dir();
        let mut fits = false;
        for a in allowed {
            match a {
                Allowed::Files(patterns) if !is_dir => {
                    fits |= patterns.iter().any(|p| matches(p, name));
                }
                Allowed::Dirs(pattern, inside) if is_dir && matches(pattern, name) => {
                    foreign.extend(foreign_entries(&path, &rel.join(&file_name), inside)?);
                    fits = true;
                }
                _ => {}
            }
            if fits {
                break;
            }
        }
        if !fits {
            foreign
                .push(rel.join(&file_name).display().to_string() + if is_dir { "/" } else { "" });
        }
    }
    Ok(foreign)
}

/// "a, b and c" of at most [`LISTED`] items ("… and N more").
fn list(items: impl Iterator<Item = String>) -> String {
    let items: Vec<String> = items.collect();
    let shown = items.len().min(LISTED);
    let mut text = items[..shown].join(", ");
    if items.len() > shown {
        text += &format!(" and {} more", items.len() - shown);
    }
    text
}

// ---------------------------------------------------------------------------------------------
// Temporaries

/// A file or directory being written under a temporary name beside its target. Dropped without
/// [`TempOutput::commit`], it is removed.
#[derive(Debug)]
pub struct TempOutput {
    path: PathBuf,
    target: PathBuf,
    kind: &'static OutputKind,
    replace: bool,
    done: bool,
}

impl TempOutput {
    /// Create the temporary directory for `target` (its parents as needed). `replace`: an
    /// existing `target` is replaced (as [`check_output`] allowed) rather than refused.
    pub fn dir(target: &Path, kind: &'static OutputKind, replace: bool) -> Result<TempOutput> {
        let (temp, ()) = Self::create(target, kind, replace, |b, dir| {
            let made = b
                .permissions(Permissions::from_mode(0o777))
                .tempdir_in(dir)?;
            Ok((made.keep(), ()))
        })?;
        Ok(temp)
    }

    /// Create the temporary file for `target` (its parents as needed), opened for writing.
    pub fn file(
        target: &Path,
        kind: &'static OutputKind,
        replace: bool,
    ) -> Result<(TempOutput, File)> {
        Self::create(target, kind, replace, |b, dir| {
            let made = b
                .permissions(Permissions::from_mode(0o666))
                .tempfile_in(dir)?;
            let (file, path) = made.keep().map_err(|e| e.error)?;
            Ok((path, file))
        })
    }

    /// `make` creates the temporary with `open(2)`/`mkdir(2)`'s modes for a plain file or
    /// directory; the umask then applies as to any other.
    fn create<T>(
        target: &Path,
        kind: &'static OutputKind,
        replace: bool,
        make: impl FnOnce(&mut tempfile::Builder, &Path) -> std::io::Result<(PathBuf, T)>,
    ) -> Result<(TempOutput, T)> {
        if !replace && std::fs::symlink_metadata(target).is_ok() {
            return Err(OutputError::Exists {
                path: target.to_path_buf(),
            });
        }
        let (dir, name) = split_target(target)?;
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        watch_signals()?;
        let prefix = temp_prefix(kind.tag, &name);
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).rand_bytes(RANDOM_CHARS);
        // Created while holding the list, so an interruption cannot miss it.
        let mut registry = live();
        let (path, made) = make(&mut builder, &dir).map_err(io_err(target))?;
        registry.push(path.clone());
        drop(registry);
        let temp = TempOutput {
            path,
            target: target.to_path_buf(),
            kind,
            replace,
            done: false,
        };
        Ok((temp, made))
    }

    /// Where it is being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The output it becomes.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Move it into place, replacing a previous output when allowed.
    pub fn commit(self) -> Result<()> {
        commit_all(vec![self])
    }
}

impl Drop for TempOutput {
    fn drop(&mut self) {
        if !self.done {
            let mut temps = live();
            remove_path(&self.path);
            temps.retain(|p| p != &self.path);
        }
    }
}

/// Move finished temporaries into place in order, as one step an interruption cannot split.
///
/// Readers of a set of files (a `.bin` and its `.idx`) key on the last one: its previous version
/// is removed first, so that a crash part-way leaves no old key beside a new partner.
pub fn commit_all(mut temps: Vec<TempOutput>) -> Result<()> {
    for t in &temps {
        if std::fs::symlink_metadata(&t.target).is_ok() {
            if !t.replace {
                return Err(OutputError::Exists {
                    path: t.target.clone(),
                });
            }
            check_replaceable(&t.target, t.kind, true)?;
        }
    }
    // Declared before the registry's guard, so dropped (and removed) after it is released.
    let mut set_aside = Vec::new();
    let mut registry = live();
    if let [_, .., last] = temps.as_slice() {
        match std::fs::remove_file(&last.target) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_err(&last.target)(e))
            }
            _ => {}
        }
    }
    for t in &mut temps {
        if t.kind.dir.is_some() && std::fs::symlink_metadata(&t.target).is_ok() {
            set_aside.push(set_aside_dir(&t.target, &mut registry)?);
        }
        std::fs::rename(&t.path, &t.target).map_err(io_err(&t.target))?;
        registry.retain(|p| p != &t.path);
        t.done = true;
    }
    drop(registry);
    drop(set_aside);
    Ok(())
}

/// Rename the directory `target` to a temporary of its own (added to `registry`, whose guard
/// the caller holds), so that the new output takes its name before the old one is deleted.
fn set_aside_dir(target: &Path, registry: &mut Vec<PathBuf>) -> Result<TempOutput> {
    static OLD: OutputKind = OutputKind {
        tag: OLD_TAG,
        what: "replaced output",
        dir: Some(&[]),
    };
    let (dir, name) = split_target(target)?;
    // An empty directory reserves the name: rename(2) replaces an empty directory.
    let aside = tempfile::Builder::new()
        .prefix(&temp_prefix(OLD.tag, &name))
        .rand_bytes(RANDOM_CHARS)
        .tempdir_in(&dir)
        .map_err(io_err(target))?
        .keep();
    if let Err(e) = std::fs::rename(target, &aside) {
        let _ = std::fs::remove_dir(&aside);
        return Err(io_err(target)(e));
    }
    registry.push(aside.clone());
    Ok(TempOutput {
        path: aside,
        target: target.to_path_buf(),
        kind: &OLD,
        replace: false,
        done: false,
    })
}

/// A file written through a buffer into a [`TempOutput`], moved into place by
/// [`AtomicFile::finish`] only when complete.
pub struct AtomicFile {
    writer: BufWriter<File>,
    temp: TempOutput,
}

impl AtomicFile {
    /// Start writing `target` (see [`TempOutput::file`]).
    pub fn create(target: &Path, kind: &'static OutputKind, replace: bool) -> Result<AtomicFile> {
        let (temp, file) = TempOutput::file(target, kind, replace)?;
        Ok(AtomicFile {
            writer: BufWriter::with_capacity(1 << 20, file),
            temp,
        })
    }

    /// The output it becomes.
    pub fn target(&self) -> &Path {
        &self.temp.target
    }

    /// Flush and sync it to disk; its length and the temporary, for [`commit_all`].
    pub fn close(self) -> Result<(u64, TempOutput)> {
        let AtomicFile { writer, temp } = self;
        let meta = writer
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|file| file.sync_all().and_then(|()| file.metadata()))
            .map_err(io_err(&temp.target))?;
        Ok((meta.len(), temp))
    }

    /// Flush, sync and move into place; returns its length.
    pub fn finish(self) -> Result<u64> {
        let (len, temp) = self.close()?;
        temp.commit()?;
        Ok(len)
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.writer.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.writer.flush()
    }
}

impl Seek for AtomicFile {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.writer.seek(pos)
    }
}

// ---------------------------------------------------------------------------------------------
// Progress

/// What a progress bar counts.
#[derive(Debug, Clone, Copy)]
pub enum ProgressUnit {
    /// Bytes (convert, preprocess): rate in bytes per second.
    Bytes,
    /// Documents (eval): the message names the task.
    Docs,
    /// Training iterations: the message carries the last loss.
    Iterations,
}

/// The progress bar of every long command, on stderr; hidden with `--quiet` (`show` false) or
/// when stderr is not a terminal.
pub fn progress_bar(total: u64, unit: ProgressUnit, show: bool) -> ProgressBar {
    if !show || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let template = match unit {
        ProgressUnit::Bytes => {
            "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}"
        }
        ProgressUnit::Docs => "{msg} [{bar:30}] {pos}/{len} docs, {per_sec}, ETA {eta}",
        ProgressUnit::Iterations => {
            "[{elapsed_precise}] {wide_bar} {pos}/{len} iterations, ETA {eta} {msg}"
        }
    };
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    static FILE: OutputKind = OutputKind {
        tag: "test",
        what: "test file",
        dir: None,
    };
    static DIR: OutputKind = OutputKind {
        tag: "testdir",
        what: "test directory",
        dir: Some(&[
            Allowed::Files(&["*.out"]),
            Allowed::Dirs("part_*", &[Allowed::Files(&["*.pt"])]),
        ]),
    };

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn temporaries_are_recognised_by_output_name_only() {
        let name = OsStr::new("out");
        assert!(is_temp_for(OsStr::new(".mindkit-hf-out-a1B2c3"), name));
        assert!(is_temp_for(OsStr::new(".mindkit-old-out-zzzzzz"), name));
        // Another output whose name starts the same, a wrong random part, another mark.
        assert!(!is_temp_for(OsStr::new(".mindkit-hf-out-2-a1B2c3"), name));
        assert!(!is_temp_for(OsStr::new(".mindkit-hf-out-a1B2c"), name));
        assert!(!is_temp_for(OsStr::new(".mindkit-hf-out-a1B2c3.x"), name));
        assert!(!is_temp_for(OsStr::new(".mindkit--out-a1B2c3"), name));
        assert!(!is_temp_for(OsStr::new("mindkit-hf-out-a1B2c3"), name));
        let prefix = temp_prefix("hf", name);
        assert_eq!(prefix, OsStr::new(".mindkit-hf-out-"));
        let target = |e: &str| temp_target(OsStr::new(e)).map(|t| t.to_vec());
        assert_eq!(
            target(".mindkit-ckpt-iter_0000002-abc123"),
            Some(b"iter_0000002".to_vec())
        );
        assert_eq!(target(".mindkit-ckpt-a-b-Zz9Zz9"), Some(b"a-b".to_vec()));
        assert_eq!(target(".mindkit-ckpt--abc123"), None);
        assert_eq!(target(".mindkit-ckpt-iter_0000002-abc12"), None);
        assert_eq!(target(".mindkit-CKPT-x-abc123"), None);
    }

    #[test]
    fn resolve_compares_spellings_of_one_place() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        std::fs::create_dir(base.join("a")).unwrap();
        std::os::unix::fs::symlink(base.join("a"), base.join("link")).unwrap();
        assert_eq!(
            resolve(&base.join("link/new/../x")).unwrap(),
            base.join("a/x")
        );
        assert_eq!(resolve(&base.join("a/./")).unwrap(), base.join("a"));
    }

    #[test]
    fn an_output_that_is_or_contains_or_lies_inside_an_input_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let proj = dir.path().join("proj");
        let model = proj.join("model");
        std::fs::create_dir_all(&model).unwrap();
        let check = |out: &Path| check_not_input(out, &[&model]);
        assert!(matches!(check(&model), Err(OutputError::IsInput { .. })));
        let e = check(&proj).unwrap_err();
        assert!(matches!(e, OutputError::ContainsInput { .. }), "{e}");
        assert!(e.to_string().contains(&*proj.to_string_lossy()), "{e}");
        assert!(e.to_string().contains(&*model.to_string_lossy()), "{e}");
        assert!(matches!(
            check(&model.join("sub")),
            Err(OutputError::InsideInput { .. })
        ));
        check(&proj.join("model-2")).unwrap();
    }

    #[test]
    fn force_replaces_only_a_previous_output() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir_all(out.join("part_1")).unwrap();
        std::fs::write(out.join("a.out"), "").unwrap();
        std::fs::write(out.join("part_1/x.pt"), "").unwrap();
        let e = check_output(&out, &DIR, &[], false).unwrap_err();
        assert!(matches!(e, OutputError::Exists { .. }), "{e}");
        check_output(&out, &DIR, &[], true).unwrap();
        std::fs::write(out.join("part_1/notes.txt"), "mine").unwrap();
        std::fs::create_dir(out.join("data")).unwrap();
        let e = check_output(&out, &DIR, &[], true).unwrap_err();
        assert!(matches!(e, OutputError::Foreign { .. }), "{e}");
        assert!(e.to_string().contains("data/, part_1/notes.txt"), "{e}");
        // A file where a directory is written, and the reverse.
        std::fs::write(dir.path().join("f"), "").unwrap();
        let e = check_output(&dir.path().join("f"), &DIR, &[], true).unwrap_err();
        assert!(matches!(e, OutputError::NotReplaceable { .. }), "{e}");
        let e = check_output(&out, &FILE, &[], true).unwrap_err();
        assert!(matches!(e, OutputError::NotReplaceable { .. }), "{e}");
    }

    #[test]
    fn stale_temporaries_named_then_removed_with_force() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let stale = dir.path().join(".mindkit-testdir-out-Ab12Cd");
        std::fs::create_dir_all(stale.join("part_1")).unwrap();
        let other = dir.path().join(".mindkit-testdir-out2-Ab12Cd");
        std::fs::create_dir(&other).unwrap();
        let e = check_output(&out, &DIR, &[], false).unwrap_err();
        assert!(matches!(e, OutputError::Stale { .. }), "{e}");
        assert!(e.to_string().contains(&*stale.to_string_lossy()), "{e}");
        assert!(!e.to_string().contains("out2"), "{e}");
        check_output(&out, &DIR, &[], true).unwrap();
        assert!(!stale.exists() && other.exists());
    }

    #[test]
    fn temporaries_get_the_umask_permissions() {
        // The umask is process-wide: read it here without changing it (via a fresh directory).
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("probe")).unwrap();
        let umask = 0o777
            & !dir
                .path()
                .join("probe")
                .metadata()
                .unwrap()
                .permissions()
                .mode();
        let mode = |p: &Path| p.metadata().unwrap().permissions().mode() & 0o777;
        let (temp, _file) = TempOutput::file(&dir.path().join("f"), &FILE, false).unwrap();
        assert_eq!(mode(temp.path()), 0o666 & !umask);
        let temp = TempOutput::dir(&dir.path().join("d"), &DIR, false).unwrap();
        assert_eq!(mode(temp.path()), 0o777 & !umask);
    }

    #[test]
    fn dropped_temporaries_are_removed_and_committed_ones_replace() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        {
            let temp = TempOutput::dir(&out, &DIR, false).unwrap();
            std::fs::write(temp.path().join("a.out"), "1").unwrap();
            assert!(live().contains(&temp.path().to_path_buf()));
        }
        assert!(names(dir.path()).is_empty());
        let temp = TempOutput::dir(&out, &DIR, false).unwrap();
        std::fs::write(temp.path().join("a.out"), "1").unwrap();
        temp.commit().unwrap();
        // Replacing: refused without `replace`, done with it (the old one moved aside, removed).
        let temp = TempOutput::dir(&out, &DIR, true).unwrap();
        std::fs::write(temp.path().join("b.out"), "2").unwrap();
        std::fs::remove_file(out.join("a.out")).unwrap();
        std::fs::write(out.join("c.out"), "old").unwrap();
        temp.commit().unwrap();
        assert_eq!(names(dir.path()), ["out"]);
        assert_eq!(names(&out), ["b.out"]);
        assert!(matches!(
            TempOutput::dir(&out, &DIR, false).unwrap_err(),
            OutputError::Exists { .. }
        ));
    }

    #[test]
    fn a_set_of_files_replaces_its_last_file_last() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("x.bin"), dir.path().join("x.idx"));
        std::fs::write(&a, "old a").unwrap();
        std::fs::write(&b, "old b").unwrap();
        let mut fa = AtomicFile::create(&a, &FILE, true).unwrap();
        fa.write_all(b"new a").unwrap();
        let mut fb = AtomicFile::create(&b, &FILE, true).unwrap();
        fb.write_all(b"new b").unwrap();
        let (len, ta) = fa.close().unwrap();
        assert_eq!(len, 5);
        let (_, tb) = fb.close().unwrap();
        // A file appearing at a target meanwhile is refused without `replace`.
        let (tc, _) = TempOutput::file(&dir.path().join("c"), &FILE, false).unwrap();
        std::fs::write(dir.path().join("c"), "mine").unwrap();
        assert!(matches!(
            commit_all(vec![tc]).unwrap_err(),
            OutputError::Exists { .. }
        ));
        commit_all(vec![ta, tb]).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"new a");
        assert_eq!(std::fs::read(&b).unwrap(), b"new b");
        assert_eq!(names(dir.path()), ["c", "x.bin", "x.idx"]);
    }

    #[test]
    fn progress_bar_is_hidden_when_quiet() {
        assert!(progress_bar(10, ProgressUnit::Bytes, false).is_hidden());
        assert!(progress_bar(10, ProgressUnit::Docs, false).is_hidden());
    }
}
