"""The MindSpeed-LLM yardstick: how many of the training scripts MindSpeed-LLM ships
(`examples/mcore/**/{pretrain,tune}_*.sh`) `mindkit train` runs, once each is shrunk to a tiny
model on one rank.

    python3 scripts/yardstick.py --mindspeed-llm DIR --mindkit BIN --assets DIR \
        [--filter qwen3] [--keep WORKDIR] [--jobs 1] [--json OUT] [--peel] [--ranks N]

For each script it
1. captures the flags the script passes to its training program: the script runs in bash with
   `torchrun`, `python` and `python3` replaced by a shell function that records its arguments,
   after every assignment the user is meant to fill in (`DATA_PATH="your data path"`) is
   replaced by a marker (`@@DATA_PATH@@`), resolved by the flag it ends up in;
2. shrinks widths and parallel sizes (`shrink`: SET, CAP, DROP) and nothing else: every other
   flag stays as written, values too;
3. makes data with `mindkit preprocess` from corpora it writes into the work directory:
   pretraining text for pretraining scripts, alpaca records through the script's handler and
   `--prompt-type` for instruction fine-tuning (when preprocessing refuses the prompt type, that
   is recorded as a blocker and the data is made with MindSpeed-LLM's own templates.json, else
   with the `empty` template, so that the training flags are still exercised); the Qwen3
   tokenizer for the Qwen family's scripts, the LLaMA-2 one for the others;
4. runs `mindkit train` with the shrunk flags on one rank, without `--load` (from scratch),
   except that a `tune_*` script with `--finetune` loads a base checkpoint that `mindkit train`
   first writes with the script's own flags minus `--finetune` and `--lora-*`;
5. prints a table (script, status, first error), the count of scripts run and a histogram of
   the blockers (each error normalised to the flag or feature it names); --json writes every
   result, --peel also reruns each refused script without the refused flag, again and again,
   to list the blockers behind the first; --ranks N also trains each script that ran with its
   own parallel layout scaled to N ranks as threads (`scaled_layout`: the script's TP, PP, EP
   and expert TP kept where they fit the tiny model, the rest data parallelism) and compares it
   with one rank on the same global batch, iteration by iteration (lm loss, grad norm).

Statuses: ok (training exited 0), refused (mindkit stopped with its own `mindkit: ...` error,
or preprocessing refused the script's prompt type), crashed (a panic, a signal, or an exit
without such a message), timeout (TIMEOUT_S), unparsed (no training launch captured).

The MindSpeed-LLM checkout is only read, and nothing needs the network. The work directory is
removed at the end unless --keep names one; checkpoints are removed after each script either way.

This runs outside CI: it needs a MindSpeed-LLM checkout and real tokenizers. Standard library
only (Python 3.11).
"""

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TIMEOUT_S = 300
CAPTURE_TIMEOUT_S = 30

# --- Shrinking -------------------------------------------------------------------------------

NUM_LAYERS = 2
HIDDEN = 64
HEADS = 4
SEQ = 64
# Width and parallel-size flags set to a fixed value.
SET = {
    "--num-layers": str(NUM_LAYERS),
    "--hidden-size": str(HIDDEN),
    "--ffn-hidden-size": "128",
    "--moe-ffn-hidden-size": "32",
    "--num-attention-heads": str(HEADS),
    "--seq-length": str(SEQ),
    "--max-position-embeddings": str(SEQ),
    "--micro-batch-size": "1",
    "--global-batch-size": "2",
    # multi-latent attention
    "--q-lora-rank": "32",
    "--kv-lora-rank": "16",
    "--qk-head-dim": "16",
    "--qk-pos-emb-head-dim": "8",
    "--v-head-dim": "16",
    "--o-lora-rank": "32",
    # DeepSeek sparse-attention indexer (its top-k counts tokens, so it follows the sequence)
    "--index-n-heads": "2",
    "--index-head-dim": "16",
    "--index-topk": "16",
    # gated delta net (linear attention)
    "--linear-key-head-dim": "16",
    "--linear-value-head-dim": "16",
    "--linear-num-key-heads": "2",
    # parallel sizes
    "--tensor-model-parallel-size": "1",
    "--pipeline-model-parallel-size": "1",
    "--context-parallel-size": "1",
    "--expert-model-parallel-size": "1",
    "--expert-tensor-parallel-size": "1",
    # length of the run
    "--train-iters": "2",
    "--save-interval": "10000",
    "--eval-interval": "10000",
}
# Counts kept at most this (a smaller original stays).
CAP = {
    "--num-experts": 4,
    "--num-zero-experts": 4,
    "--moe-router-topk": 2,
    "--moe-router-group-topk": 1,
    "--moe-router-num-groups": 2,
    "--o-groups": 2,
    # layer counts and periods, kept within the 2 layers: one dense and one MoE layer, one
    # hash-routed layer, one linear- and one full-attention layer
    "--first-k-dense-replace": 1,
    "--n-hash-layers": 1,
    "--full-attention-interval": NUM_LAYERS,
    "--recompute-num-layers": NUM_LAYERS,
}
# Pipeline-stage layout, meaningless with one stage: per-stage layer counts and lists, virtual
# pipeline sizing, the no-op layers that pad a model to a multiple of the stages, and MindSpeed's
# DualPipeV schedule (it refuses it below two stages, and the 2-layer model has no 2 × 2 chunks).
DROP = {
    "--schedules-method",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--num-layer-list",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--noop-layers",
}
# Flags that only fine-tuning from a base model has; the base checkpoint is written without them.
TUNE_ONLY = re.compile(r"^--(finetune|lora-.*)$")


@dataclasses.dataclass
class Flag:
    """One command-line flag and the values that follow it."""

    name: str
    values: list


def parse_flags(args):
    """Splits an argument list into Flags: each `--name` with the non-flag words after it."""
    flags = []
    for a in args:
        if a.startswith("--"):
            flags.append(Flag(a, []))
        elif flags:
            flags[-1].values.append(a)
        else:
            raise ValueError(f"argument {a!r} before any flag")
    return flags


def flatten(flags):
    """The argument list of Flags."""
    return [w for f in flags for w in [f.name, *f.values]]


def value(flags, name):
    """The first value of the last occurrence of `name` (argparse keeps the last), or None."""
    found = [f for f in flags if f.name == name and f.values]
    return found[-1].values[0] if found else None


def has(flags, name):
    """Whether `name` is given."""
    return any(f.name == name for f in flags)


def as_int(text):
    """`text` as an int, or None."""
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def shrink(flags, padded_vocab):
    """Shrinks widths and parallel sizes to a tiny one-rank model; returns (flags, changes).

    Every flag not named here keeps its values. Relative settings stay consistent: grouped-query
    attention keeps its kind (MHA, MQA, GQA), `--kv-channels` stays unequal to hidden/heads when it
    was, the shared-expert width stays a multiple of the expert width, per-layer lists keep their
    extra (MTP) entries, RoPE factor lists keep one entry per rotary frequency.
    """
    heads = as_int(value(flags, "--num-attention-heads"))
    hidden = as_int(value(flags, "--hidden-size"))
    layers = as_int(value(flags, "--num-layers"))
    moe_ffn = as_int(value(flags, "--moe-ffn-hidden-size"))
    key_heads = as_int(value(flags, "--linear-num-key-heads"))
    kv = as_int(value(flags, "--kv-channels"))
    head_dim = kv or (hidden // heads if hidden and heads else None)
    new_head_dim = {True: 32, False: 16}[bool(kv and heads and hidden and kv != hidden // heads)]
    has_decay_iters = has(flags, "--lr-decay-iters")

    def new_values(name, vals):
        one = vals[0] if len(vals) == 1 else None
        n = as_int(one)
        if name in SET:
            return [SET[name]]
        if name in CAP and n is not None:
            return [str(min(n, CAP[name]))]
        if name == "--num-query-groups" and n is not None:
            return [str(HEADS if n == heads else 1 if n == 1 else 2)]
        if name == "--kv-channels":
            return [str(new_head_dim)]
        if name == "--moe-shared-expert-intermediate-size" and n is not None:
            multiple = max(1, round(n / moe_ffn)) if moe_ffn else 1
            return [str(int(SET["--moe-ffn-hidden-size"]) * multiple)]
        if name == "--linear-num-value-heads" and n is not None:
            per_key = max(1, n // key_heads) if key_heads else 1
            return [str(int(SET["--linear-num-key-heads"]) * per_key)]
        if name == "--padded-vocab-size":
            return [str(padded_vocab)]
        if name == "--lr-warmup-iters" and n is not None and not has_decay_iters:
            # the warmup must end before the decay, which is --train-iters long here
            return [str(min(n, int(SET["--train-iters"]) - 1))]
        if name == "--compress-ratios" and layers:
            return vals[: NUM_LAYERS + max(0, len(vals) - layers)]
        if name in ("--short-factor", "--long-factor") and one and head_dim:
            factors = one.split(",")
            return [",".join(factors[: len(factors) * new_head_dim // head_dim])]
        return vals

    out, changes = [], []
    for f in flags:
        if f.name in DROP:
            changes.append(f"{f.name} {' '.join(f.values)}: dropped".strip())
            continue
        vals = new_values(f.name, f.values)
        if vals != f.values:
            changes.append(f"{f.name} {' '.join(f.values)} → {' '.join(vals)}")
        out.append(Flag(f.name, vals))
    return out, changes


# --- Capturing a script's launch -------------------------------------------------------------

# Stand-ins for the launchers: each call appends its argument count and arguments, NUL-separated.
PRELUDE = r"""
__yardstick_record() { { printf '%s\0' "$#"; printf '%s\0' "$@"; } >> "$YARDSTICK_CAPTURE"; }
torchrun() { __yardstick_record torchrun "$@"; }
python() { __yardstick_record python "$@"; }
python3() { __yardstick_record python3 "$@"; }
"""
ASSIGNMENT = re.compile(r"^(\s*)(export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
PLACEHOLDER = re.compile(r"\byour\b", re.IGNORECASE)
MARKER = re.compile(r"@@([A-Za-z_][A-Za-z0-9_]*)@@")
TRAIN_PROGRAM = re.compile(r"(^|/)(pre|post)train_\w*\.py$")


class Unparsed(Exception):
    """A script whose training launch could not be captured."""


def mark_placeholders(text):
    """The script with each `VAR="your ..."` assignment replaced by `VAR="@@VAR@@"`."""
    lines = []
    for line in text.split("\n"):
        m = ASSIGNMENT.match(line)
        if m and PLACEHOLDER.search(m[4]):
            line = f'{m[1]}{m[2] or ""}{m[3]}="@@{m[3]}@@"'
        lines.append(line)
    return "\n".join(lines)


def capture(script, scratch):
    """Runs `script` with the launchers stubbed out, in `scratch`; returns the flags of its
    training launch and notes on anything out of the ordinary."""
    notes = []
    text = script.read_text(encoding="utf-8", errors="replace")
    if "\r\n" in text:
        text = text.replace("\r\n", "\n")
        notes.append("CRLF line ends read as LF")
    scratch.mkdir(parents=True)
    (scratch / "logs").mkdir()
    stub = scratch / "script.sh"
    stub.write_text(PRELUDE + mark_placeholders(text), encoding="utf-8")
    record = scratch / "launches"
    record.write_bytes(b"")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(scratch),
           "YARDSTICK_CAPTURE": str(record)}
    try:
        done = subprocess.run(["bash", "--noprofile", "--norc", str(stub)], cwd=scratch, env=env,
                              capture_output=True, text=True, timeout=CAPTURE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Unparsed(f"bash did not finish in {CAPTURE_TIMEOUT_S} s") from None
    words = record.read_bytes().split(b"\0")[:-1]
    calls = []
    while words:
        n = int(words[0])
        calls.append([w.decode("utf-8", "replace") for w in words[1 : 1 + n]])
        words = words[1 + n :]
    launches = [c for c in calls if any(TRAIN_PROGRAM.search(w) for w in c)]
    if not launches:
        err = done.stderr.strip().splitlines()
        raise Unparsed("no pretrain_*.py / posttrain_*.py launch"
                       + (f" ({err[-1]})" if err else ""))
    if len(launches) > 1:
        notes.append(f"{len(launches)} training launches; the first is measured")
    argv = launches[0]
    at = next(i for i, w in enumerate(argv) if TRAIN_PROGRAM.search(w))
    program = Path(argv[at]).name
    if program not in ("pretrain_gpt.py", "posttrain_gpt.py"):
        notes.append(f"launches {program}, taken as pretrain_gpt.py")
    try:
        flags = parse_flags(argv[at + 1 :])
    except ValueError as e:
        raise Unparsed(str(e)) from None
    return flags, notes


# --- Data ------------------------------------------------------------------------------------

WORDS = ("the a of and to in river stone light garden quiet north market song winter bread "
         "window old new small bright city road learns carries builds opens under over before "
         "after morning evening teacher farmer letter bridge mountain cloud field").split()


def sentence(rng, n):
    """`n` words from WORDS, capitalised, with a full stop."""
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def write_corpora(root):
    """Writes the pretraining corpus (1024 documents, so that a 949,50,1 split leaves the test
    split one) and the alpaca-style instruction set (1024 short records, each also with a chosen
    and a rejected answer for the pairwise handlers); returns their paths."""
    rng = random.Random(1234)
    rejected = random.Random(4321)
    text, alpaca = root / "pretrain.jsonl", root / "alpaca.jsonl"
    with text.open("w", encoding="utf-8") as f:
        for _ in range(1024):
            doc = " ".join(sentence(rng, rng.randint(6, 14)) for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({"text": doc}) + "\n")
    with alpaca.open("w", encoding="utf-8") as f:
        for _ in range(1024):
            record = {"instruction": sentence(rng, rng.randint(3, 7)),
                      "input": sentence(rng, rng.randint(0, 4)) if rng.random() < 0.3 else "",
                      "output": sentence(rng, rng.randint(3, 9))}
            record.update(chosen=record["output"], rejected=sentence(rejected, rejected.randint(3, 9)))
            f.write(json.dumps(record) + "\n")
    return text, alpaca


def padded_vocab_size(tokenizer_dir, stop_words=()):
    """The tokenizer's vocabulary (highest id + 1), with the prompt type's `stop_words` it lacks
    (MindSpeed-LLM's tokenizer, as mindkit's, adds them as special tokens), rounded up to a
    multiple of 128; for a tekken file mistral-common's `n_words`, its config's
    default_vocab_size."""
    if is_tekken(tokenizer_dir):
        config = json.loads(tokenizer_dir.read_text(encoding="utf-8"))["config"]
        return -(-config["default_vocab_size"] // 128) * 128
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    added = spec.get("added_tokens", [])
    ids = list(spec["model"]["vocab"].values()) + [t["id"] for t in added]
    known = set(spec["model"]["vocab"]) | {t["content"] for t in added}
    missing = {w for w in stop_words if w not in known}
    return -(-(max(ids) + 1 + len(missing)) // 128) * 128


def stop_words(templates, prompt_type):
    """The stop words MindSpeed-LLM's templates.json gives `prompt_type` (none when unknown)."""
    if prompt_type is None or not templates.is_file():
        return []
    entries = json.loads(templates.read_text(encoding="utf-8"))
    return next((t.get("stop_words", []) for t in entries if t.get("name") == prompt_type), [])


@dataclasses.dataclass
class Step:
    """One mindkit command and how it ended."""

    name: str
    argv: list
    status: str = ""
    rc: int = None
    error: str = ""
    seconds: float = 0.0


def run_step(step, cwd, log):
    """Runs `step.argv` in `cwd` (output to `log`, timeout TIMEOUT_S) and classifies its end."""
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(step.argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            step.rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            step.status, step.error = "timeout", f"no exit after {TIMEOUT_S} s"
    step.seconds = round(time.monotonic() - start, 1)
    if step.status == "timeout":
        return step
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    said = [l.strip() for l in lines
            if l.startswith("mindkit:") and not l.startswith("mindkit: warning:")]
    panic = [l.strip() for l in lines if "panicked at" in l]
    if step.rc == 0:
        step.status = "ok"
    elif panic or step.rc < 0 or not said:
        step.status = "crashed"
        tail = [l.strip() for l in lines if l.strip()]
        step.error = (panic or said[-1:] or tail[-1:] or [f"exit status {step.rc}"])[0]
        if step.rc < 0:
            step.error = f"killed by signal {-step.rc}: {step.error}"
    else:
        step.status, step.error = "refused", said[-1]
    return step


class Data:
    """Datasets made with `mindkit preprocess`, once per tokenizer and setting, shared by runs."""

    def __init__(self, mindkit, root, templates):
        self.mindkit, self.root, self.templates = mindkit, root, templates
        self.text, self.alpaca = write_corpora(root)
        self.made = {}
        self.lock = threading.Lock()

    def pretrain(self, tokenizer):
        """The pretraining prefix for `tokenizer`, or raises RuntimeError with the refusal."""
        key = ("pretrain", tokenizer.name)
        with self.lock:
            if key not in self.made:
                prefix = self.root / tokenizer.name / "pretrain"
                prefix.parent.mkdir(exist_ok=True)
                step = self._preprocess(prefix, ["--input", str(self.text), "--tokenizer",
                                                 str(tokenizer), "--append-eod"])
                self.made[key] = (Path(f"{prefix}_text_document"), step)
            path, step = self.made[key]
        if step.status != "ok":
            raise RuntimeError(step.error)
        return path

    def instruction(self, tokenizer, handler, prompt, pack):
        """Instruction data for the script's handler and `--prompt-type`: (prefix, refusal, note).

        When preprocessing refuses the prompt type, the data is made with MindSpeed-LLM's own
        templates.json (`--prompt-type-path`) and then with the built-in `empty` template, so
        that the training flags are still exercised; the refusal is returned to be recorded.
        """
        attempts = [("no-template", [], None)]
        if prompt:
            attempts = [(prompt, ["--prompt-type", prompt], None),
                        (f"{prompt}-msllm-templates",
                         ["--prompt-type", prompt, "--prompt-type-path", str(self.templates)],
                         f"data made with --prompt-type-path {self.templates}"),
                        ("empty", ["--prompt-type", "empty"], "data made with --prompt-type empty")]
        refusal = None
        for label, extra, note in attempts:
            key = (tokenizer.name, handler, label, pack)
            with self.lock:
                if key not in self.made:
                    name = "-".join([handler, label, *(["pack"] if pack else [])])
                    prefix = self.root / tokenizer.name / name
                    prefix.parent.mkdir(exist_ok=True)
                    step = self._preprocess(prefix, [
                        "--input", str(self.alpaca), "--tokenizer", str(tokenizer),
                        "--handler", handler, "--seq-length", str(SEQ), *extra,
                        *(["--pack"] if pack else [])])
                    self.made[key] = (prefix, step)
                path, step = self.made[key]
            if step.status == "ok":
                return path, refusal, note
            refusal = refusal or step.error
        raise RuntimeError(refusal)

    def _preprocess(self, prefix, args):
        tokenizer = Path(args[args.index("--tokenizer") + 1])
        kind = ["--tokenizer-type", "MagistralTokenizer"] if is_tekken(tokenizer) else []
        step = Step("preprocess", [str(self.mindkit), "preprocess", "--output-prefix", str(prefix),
                                   "--quiet", *args, *kind])
        return run_step(step, self.root, Path(f"{prefix}.log"))


# --- One script ------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    """Everything measured for one script.

    `error` is the training's first error line (or that of the step before it that failed),
    prefixed by `[preprocess refused R]` when the data could only be made by a fallback;
    `reasons` are the normalised blockers, the preprocessing ones marked `[preprocess]`. With
    --peel, `behind` are the blockers met once each refused flag is removed in turn, and
    `peeled` how that ended (`runs`, or the status of the last run).
    """

    script: str
    status: str = ""
    error: str = ""
    reasons: list = dataclasses.field(default_factory=list)
    tokenizer: str = ""
    data: str = ""
    load: str = ""
    notes: list = dataclasses.field(default_factory=list)
    changes: list = dataclasses.field(default_factory=list)
    steps: list = dataclasses.field(default_factory=list)
    behind: list = dataclasses.field(default_factory=list)
    peeled: str = ""
    scaled: dict = dataclasses.field(default_factory=dict)


def family_tokenizer(script, assets):
    """The Qwen3 tokenizer for the Qwen family's scripts (a `qwen*` directory), Mistral's tekken.json
    for the Magistral ones (they pass --tokenizer-type MagistralTokenizer), else LLaMA-2."""
    family = script.parent.name.lower()
    if family.startswith("magistral"):
        return assets / "tekken" / "tekken.json"
    return assets / ("qwen3" if family.startswith("qwen") else "llama2")


def is_tekken(tokenizer):
    """A tekken file (mistral-common's rule: a .json whose name contains "tekken")."""
    return tokenizer.suffix == ".json" and "tekken" in tokenizer.name


def resolve_paths(flags, rundir, tokenizer, notes):
    """Replaces the `@@VAR@@` markers: tokenizer flags get the tokenizer, `--save` `save` (in the
    directory the run starts in), any other path flag an empty directory named after the
    variable. `--data-path` and `--load` are left for the data and load policies."""
    out = []
    for f in flags:
        if not any(MARKER.search(v) for v in f.values):
            out.append(f)
        elif f.name in ("--tokenizer-name-or-path", "--tokenizer-model"):
            out.append(Flag(f.name, [str(tokenizer)]))
        elif f.name == "--save":
            out.append(Flag(f.name, ["save"]))  # relative: each run's own directory
        elif f.name in ("--data-path", "--load"):
            out.append(f)
        else:
            var = MARKER.search(" ".join(f.values))[1]
            empty = rundir / "paths" / var
            empty.mkdir(parents=True, exist_ok=True)
            notes.append(f"{f.name} ${var}: an empty directory")
            out.append(Flag(f.name, [str(empty)]))
    return out


def with_flag(flags, name, values):
    """`flags` with the first `name` given `values` and any later ones removed (appended when
    absent)."""
    out, done = [], False
    for f in flags:
        if f.name == name:
            if not done:
                out.append(Flag(name, values))
            done = True
        else:
            out.append(f)
    return out if done else out + [Flag(name, values)]


def measure(script, rel, args, data, workdir):
    """Captures, shrinks and runs one script; returns its Result."""
    res = Result(rel)
    rundir = workdir / "runs" / re.sub(r"[^\w.-]+", "_", rel)
    try:
        flags, res.notes = capture(script, rundir / "capture")
    except Unparsed as e:
        res.status, res.error, res.reasons = "unparsed", str(e), ["unparsed script"]
        return res
    original = flags
    tokenizer = family_tokenizer(script, args.assets)
    res.tokenizer = tokenizer.name
    words = stop_words(data.templates, value(flags, "--prompt-type"))
    flags, res.changes = shrink(flags, padded_vocab_size(tokenizer, words))
    flags = resolve_paths(flags, rundir, tokenizer, res.notes)
    try:
        flags = attach_data(flags, data, tokenizer, res)
    except RuntimeError as e:
        res.status, res.error = "refused", f"preprocess: {e}"
        res.reasons.append(f"{blocker(str(e))} [preprocess]")
        return res
    prep = [r.removesuffix(" [preprocess]") for r in res.reasons]

    base = script.name.startswith("tune_") and has(flags, "--finetune") and has(flags, "--load")
    res.load = ("a base checkpoint written by mindkit train (without --finetune, --lora-*)"
                if base else
                "none: from scratch" + (" (--load dropped)" if has(flags, "--load") else ""))
    res.steps = run_pipeline(args.mindkit, flags, base, rundir)
    (rundir / "command.sh").write_text(
        '# The shrunk commands, run from this directory.\ncd "$(dirname "$0")"\n'
        + "".join(shlex.join(s.argv) + "\n" for s in res.steps), encoding="utf-8")
    last = res.steps[-1]
    prefix = f"[preprocess refused {', '.join(prep)}] " if prep else ""
    if last.status == "ok":
        res.status = "refused" if prep else "ok"
        res.error = prefix + "(training ran on the fallback data)" if prep else ""
    else:
        res.status = last.status
        res.error = prefix + ("" if last.name == "train" else f"{last.name}: ") + last.error
        res.reasons.append(reason(last))

    if args.peel and last.status == "refused":
        while last.status == "refused" and reason(last).split()[0] in {f.name for f in flags}:
            flags = [f for f in flags if f.name != reason(last).split()[0]]
            last = run_pipeline(args.mindkit, flags, base, rundir / "peel")[-1]
            if last.status != "ok":
                res.behind.append(reason(last))
        res.peeled = "runs" if last.status == "ok" else last.status
    if args.ranks and res.status == "ok":
        res.scaled = compare_scaled(args, original, flags, base, rundir)
    return res


# Iteration lines' values compared between one rank and the scaled layout.
LOGGED = {"lm loss": re.compile(r"lm loss: ([-+\d.eE]+)"),
          "grad norm": re.compile(r"grad norm: ([-+\d.eE]+)")}
# The global batch of both runs: a multiple of every data-parallel size up to 8 ranks.
SCALED_BATCH = "8"


def scaled_layout(original, ranks):
    """The script's parallel flags (`original`: as it passes them) scaled to `ranks` ranks of
    the tiny model: TP and PP up to 2 (4 heads in 2 query groups, 2 layers), EP up to the
    experts kept and the data-parallel ranks left, the expert TP as given (at most TP), the rest
    data parallelism. Returns (flags to set, a description)."""
    size = lambda name: as_int(value(original, name)) or 1
    tp = min(size("--tensor-model-parallel-size"), 2)
    pp = min(size("--pipeline-model-parallel-size"), 2)
    while ranks % (tp * pp):
        tp, pp = (tp, pp // 2) if pp > 1 else (tp // 2, pp)
    dp = ranks // (tp * pp)
    experts = min(as_int(value(original, "--num-experts")) or 1, CAP["--num-experts"])
    ep = min(size("--expert-model-parallel-size"), experts, dp)
    while dp % ep or experts % ep:
        ep -= 1
    layout = {"--tensor-model-parallel-size": str(tp), "--pipeline-model-parallel-size": str(pp),
              "--expert-model-parallel-size": str(ep), "--world-size": str(ranks)}
    etp = as_int(value(original, "--expert-tensor-parallel-size"))
    if etp is not None:
        layout["--expert-tensor-parallel-size"] = str(min(etp, tp))
    words = [f"TP {tp}", f"PP {pp}", f"DP {dp}"] + ([f"EP {ep}"] if ep > 1 else [])
    if etp is not None:
        words.append(f"ETP {min(etp, tp)}")
    return layout, " × ".join(words[:3]) + "".join(f", {w}" for w in words[3:])


def logged(log):
    """Each iteration line's LOGGED values, by name."""
    text = log.read_text(encoding="utf-8", errors="replace")
    return {name: [float(x) for x in pattern.findall(text)] for name, pattern in LOGGED.items()}


def compare_scaled(args, original, flags, base, rundir):
    """One rank and the script's layout scaled to `args.ranks` ranks, both on SCALED_BATCH
    samples per iteration: the layout, each run's status, and the largest relative differences
    of the logged values."""
    layout, described = scaled_layout(original, args.ranks)
    batch = with_flag(flags, "--global-batch-size", [SCALED_BATCH])
    out = {"layout": described}
    runs = {}
    for name, extra in (("one rank", {}), ("scaled", layout)):
        run_flags = batch
        for flag, v in extra.items():
            run_flags = with_flag(run_flags, flag, [v])
        last = run_pipeline(args.mindkit, run_flags, base, rundir / name.replace(" ", "_"))[-1]
        if last.status != "ok":
            out[name] = f"{last.status}: " + ("" if last.name == "train" else f"{last.name}: ") + last.error
            continue
        out[name] = "ok"
        runs[name] = logged(rundir / name.replace(" ", "_") / "train.log")
    if out["one rank"] == out["scaled"] == "ok":
        for key in LOGGED:
            one, scaled = runs["one rank"][key], runs["scaled"][key]
            if len(one) != len(scaled) or not one:
                out[key] = f"{len(one)} vs {len(scaled)} iterations logged"
                continue
            out[key] = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(one, scaled))
    return out


def reason(step):
    """The blocker a failed step names (`crashed: ...` / `timeout: ...` unless refused)."""
    if step.status == "refused":
        return blocker(step.error)
    return f"{step.status}: {blocker(step.error)}"


def run_pipeline(mindkit, flags, base, rundir):
    """Runs `mindkit train` with `flags` in `rundir`; with `base`, first writes the base
    checkpoint that `--load` then names. Removes the checkpoints after; returns the Steps."""
    train = [str(mindkit), "train"]
    steps = []
    rundir.mkdir(parents=True, exist_ok=True)
    if base:
        ckpt = rundir / "base"
        first = [f for f in flags if f.name != "--load" and not TUNE_ONLY.match(f.name)]
        first = with_flag(first, "--save", [str(ckpt)])
        steps.append(run_step(Step("base checkpoint", train + flatten(first)), rundir,
                              rundir / "base.log"))
        flags = with_flag(flags, "--load", [str(ckpt)])
    else:
        flags = [f for f in flags if f.name != "--load"]
    if not steps or steps[-1].status == "ok":
        steps.append(run_step(Step("train", train + flatten(flags)), rundir, rundir / "train.log"))
    for ckpt in ("base", "save"):
        shutil.rmtree(rundir / ckpt, ignore_errors=True)
    return steps


def attach_data(flags, data, tokenizer, res):
    """Points `--data-path` at data made for the script; records preprocessing refusals in `res`.

    Pretraining scripts get the text corpus; `--is-instruction-dataset` scripts alpaca records
    through their `--handler-name` and `--prompt-type`, packed when they train with `--pack` or
    `--neat-pack`. `--is-pairwise-dataset` (DPO) scripts get preference pairs made by
    AlpacaStylePairwiseHandler, as MindSpeed-LLM's DPO data scripts make them (the training
    scripts' own `--handler-name` is not read by training).
    """
    pairwise = has(flags, "--is-pairwise-dataset")
    if has(flags, "--is-instruction-dataset") or pairwise:
        handler = value(flags, "--handler-name") or "AlpacaStyleInstructionHandler"
        if handler == "GeneralPretrainHandler":
            # training never reads --handler-name; a pretraining handler's documents are no
            # instruction dataset (deepseek32's tune script names one): its data is made as
            # the instruction scripts' is
            res.notes.append("--handler-name GeneralPretrainHandler with --is-instruction-dataset: alpaca instruction data")
            handler = "AlpacaStyleInstructionHandler"
        if pairwise:
            handler = "AlpacaStylePairwiseHandler"
        pack = has(flags, "--pack") or has(flags, "--neat-pack")
        prompt = value(flags, "--prompt-type")
        prefix, refusal, note = data.instruction(tokenizer, handler, prompt, pack)
        res.data = f"instruction ({handler}{', packed' if pack else ''})"
        if refusal:
            res.reasons.append(f"{blocker(refusal)} [preprocess]")
            res.notes.append(note)
    else:
        prefix = data.pretrain(tokenizer)
        res.data = "pretraining text"
    return with_flag(flags, "--data-path", [str(prefix)])


# --- Reporting -------------------------------------------------------------------------------

FLAG = re.compile(r"--[A-Za-z0-9][\w-]*")
# `--flag`, `--flag value`, `--flag value is ...`, `--flag is required`
LEADING_FLAG = re.compile(
    r"(--[A-Za-z0-9][\w-]*)(?: (?!is\b)([^\s()]+)(?=$| is\b))?(?: is (required))?")
QUOTED = re.compile(r"prompt type \"([^\"]+)\"")


def blocker(error):
    """The flag or feature an error names, e.g. `mindkit: unknown flag --spec (...)` → `--spec`;
    `--prompt-type cpm: unknown prompt type "cpm"` → `--prompt-type cpm`; `--swiglu is required:
    ...` → `--swiglu required`.

    mindkit's errors are chains of `context: cause`; the innermost part that starts with a flag
    names it, with its value when one follows (as `--flag value` or as the next part), unless
    numeric. An error naming no flag becomes its first two parts up to any `;` or `(`, with
    paths replaced by PATH.
    """
    text = error.removeprefix("mindkit:").strip()
    if text.startswith("unknown flag"):
        return FLAG.search(text)[0]
    parts = [p.strip() for p in re.split(r": |; ", text)]
    for i in reversed(range(len(parts))):
        m = LEADING_FLAG.match(parts[i])
        if not m:
            continue
        name, v, required = m[1], m[2], m[3]
        if required:
            return f"{name} required"
        if v is None and i + 1 < len(parts) and re.fullmatch(r"[\w.-]+", parts[i + 1]):
            v = parts[i + 1]
        if v is None or re.fullmatch(r"[\d.e+-]+", v):
            quoted = QUOTED.search(text)
            return f"{name} {quoted[1]}" if quoted else name
        return f"{name} {v}"
    plain = re.split(r"; | \(", re.sub(r"/[^\s:]+", "PATH", text))[0]
    return ": ".join(plain.split(": ")[:2])[:80]


def report(results, out=sys.stdout):
    """Prints the per-script table, the count and the blocker histogram; with peeled results,
    what stood behind each first blocker and a histogram of every blocker found."""
    width = max(len(r.script) for r in results)
    print(f"{'script'.ljust(width)}  {'status':8}  first error", file=out)
    for r in results:
        print(f"{r.script.ljust(width)}  {r.status:8}  {r.error}", file=out)
    ok = sum(r.status == "ok" for r in results)
    print(f"\n{ok} of {len(results)} scripts run", file=out)
    statuses = collections.Counter(r.status for r in results)
    print("by status: " + ", ".join(f"{s} {n}" for s, n in statuses.most_common()), file=out)
    histogram("blockers (scripts; [preprocess]: data preparation)",
              [r.reasons for r in results], out)
    peeled = [r for r in results if r.peeled]
    if peeled:
        print("\nbehind the first blocker (--peel: each refused flag removed in turn):", file=out)
        for r in peeled:
            print(f"{r.script}: {' → '.join(r.reasons[-1:] + r.behind)} ⇒ {r.peeled}", file=out)
        histogram("every blocker found (scripts)", [r.reasons + r.behind for r in results], out)
    scaled = [r for r in results if r.scaled]
    if scaled:
        print("\nscaled to several ranks (--ranks), against one rank on the same batches "
              "(largest relative difference per iteration):", file=out)
        for r in scaled:
            s = r.scaled
            diffs = ", ".join(f"{k} {s[k]:.1e}" if isinstance(s.get(k), float) else f"{k} {s.get(k)}"
                              for k in LOGGED if k in s)
            status = diffs or f"one rank: {s['one rank']}; scaled: {s['scaled']}"
            print(f"{r.script}: {s['layout']}: {status}", file=out)


def histogram(title, reasons, out):
    """Prints how many scripts name each reason, most first."""
    counts = collections.Counter(x for rs in reasons for x in dict.fromkeys(rs))
    if counts:
        print(f"\n{title}:", file=out)
        for x, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"{n:5d}  {x}", file=out)


def find_scripts(root, filters):
    """The `examples/mcore/**/{pretrain,tune}_*.sh` scripts, sorted, matching any filter."""
    found = sorted(p for p in (root / "examples" / "mcore").rglob("*.sh")
                   if re.match(r"(pretrain|tune)_", p.name))
    rel = [(p, str(p.relative_to(root))) for p in found]
    return [(p, r) for p, r in rel if not filters or any(f.lower() in r.lower() for f in filters)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mindspeed-llm", type=Path, required=True, metavar="DIR",
                   help="MindSpeed-LLM checkout (only read)")
    p.add_argument("--mindkit", type=Path, required=True, metavar="BIN",
                   help="the mindkit binary to measure")
    p.add_argument("--assets", type=Path, required=True, metavar="DIR",
                   help="directory holding the qwen3/ and llama2/ tokenizer directories")
    p.add_argument("--filter", action="append", default=[], metavar="TEXT",
                   help="only scripts whose path contains this (repeatable)")
    p.add_argument("--keep", type=Path, metavar="WORKDIR",
                   help="work here and keep it (per script: capture/, command.sh, logs; data/); "
                        "runs/ and data/ left by an earlier run are replaced")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="scripts run at once (default 1)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write every result here")
    p.add_argument("--peel", action="store_true",
                   help="after a refusal naming a flag, rerun without it, until the run ends "
                        "otherwise: lists the blockers behind the first")
    p.add_argument("--ranks", type=int, metavar="N",
                   help="also train each script that runs with its parallel layout scaled to N "
                        "ranks (threads) and compare it with one rank")
    args = p.parse_args()
    args.mindspeed_llm, args.mindkit, args.assets = (
        x.resolve() for x in (args.mindspeed_llm, args.mindkit, args.assets))
    for need in (args.mindkit, args.assets / "qwen3" / "tokenizer.json",
                 args.assets / "llama2" / "tokenizer.json"):
        if not need.is_file():
            p.error(f"{need} not found")
    scripts = find_scripts(args.mindspeed_llm, args.filter)
    if not scripts:
        p.error("no script matches")

    if args.keep:
        workdir = args.keep.resolve()
        for old in ("runs", "data"):
            shutil.rmtree(workdir / old, ignore_errors=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="yardstick-"))
    version = subprocess.run([args.mindkit, "--version"], capture_output=True, text=True).stdout
    try:
        (workdir / "data").mkdir(parents=True)
        data = Data(args.mindkit, workdir / "data",
                    args.mindspeed_llm / "configs" / "finetune" / "templates.json")
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = [pool.submit(measure, s, rel, args, data, workdir) for s, rel in scripts]
            results = []
            for (_, rel), fut in zip(scripts, futures):
                results.append(fut.result())
                print(f"[{len(results)}/{len(scripts)}] {rel}: {results[-1].status}",
                      file=sys.stderr, flush=True)
        print(f"{version.strip()} ({args.mindkit}) on {args.mindspeed_llm}\n")
        report(results)
        if args.json:
            args.json.write_text(json.dumps({
                "mindspeed_llm": str(args.mindspeed_llm), "mindkit": str(args.mindkit),
                "mindkit_version": version.strip(),
                "ok": sum(r.status == "ok" for r in results), "scripts": len(results),
                "results": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
