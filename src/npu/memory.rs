//! Device memory: a caching pool over `aclrtMalloc` (blocks are kept by size class and handed
//! out again, so a training step allocates nothing once the first has run), and the host
//! staging buffers of copies queued on the stream.
//!
//! One stream orders all work, so a block released while queued work still uses it can be
//! handed to a later operation at once: that operation runs after the earlier work (the
//! scheme of ggml-cann's pool and torch_npu's caching allocator for a single stream).

use std::collections::BTreeMap;

/// Requests are rounded up to a multiple of this (and blocks are 512-byte aligned by the
/// runtime), so that near sizes share a class.
const SMALL_CLASS: usize = 512;
/// Above this, classes are multiples of 1 MiB (fewer, larger classes for weights).
const LARGE_FROM: usize = 1 << 20;

/// The size class a request of `bytes` is served from.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    if bytes < LARGE_FROM {
        bytes.next_multiple_of(SMALL_CLASS)
    } else {
        bytes.next_multiple_of(LARGE_FROM)
    }
}

/// Cached free blocks by size class; what is live and cached, for the summary.
#[derive(Default)]
pub struct Pool {
    free: BTreeMap<usize, Vec<usize>>,
    /// Bytes handed out now.
    pub live: usize,
    /// Bytes cached, free.
    pub cached: usize,
    /// The most bytes ever handed out at once.
    pub peak: usize,
}

impl Pool {
    /// A cached block of `class` bytes, if there is one.
    pub fn take(&mut self, class: usize) -> Option<usize> {
        let ptr = self.free.get_mut(&class)?.pop()?;
        self.cached -= class;
        self.handed_out(class);
        Some(ptr)
    }

    /// Count a block of `class` bytes as handed out.
    pub fn handed_out(&mut self, class: usize) {
        self.live += class;
        self.peak = self.peak.max(self.live);
    }

    /// Take back a block.
    pub fn put(&mut self, ptr: usize, class: usize) {
        self.live -= class;
        self.cached += class;
        self.free.entry(class).or_default().push(ptr);
    }

    /// Every cached block, removed from the pool (to be freed).
    pub fn drain(&mut self) -> Vec<usize> {
        self.cached = 0;
        std::mem::take(&mut self.free)
            .into_values()
            .flatten()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_back_by_class() {
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        let mut pool = Pool::default();
        pool.handed_out(1024);
        pool.put(0x1000, 1024);
        assert_eq!(pool.take(512), None);
        assert_eq!(pool.take(1024), Some(0x1000));
        assert_eq!((pool.live, pool.cached, pool.peak), (1024, 0, 1024));
        pool.put(0x1000, 1024);
        assert_eq!(pool.drain(), vec![0x1000]);
        assert_eq!(pool.cached, 0);
    }
}
