//! What the frames listeners let one client take beyond its place under the cap
//! (`floodgate_core::admission`): the bytes all connections may hold in frames still arriving.

use std::sync::Arc;

use tokio::sync::Semaphore;

/// Most connections one listener holds open by default (each costs a task and its buffers, about
/// 16 KiB idle; a host's services need far fewer, an accept loop gone wrong far more).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4_096;

/// What every frames connection's read buffer holds without asking: a legitimate frame is at most
/// ~7 KiB (16 items of 256-byte keys), so it always fits; a pipelining client's read of 4 KiB of
/// small checks too.
pub const BASE_BUFFER: usize = 8 * 1024;

/// The bytes all frames connections together may hold in read buffers past [`BASE_BUFFER`] (a frame
/// of up to 64 KiB announced and still arriving): 32 MiB, 512 such frames at once. Without it, each
/// half-sent frame held ~71 KiB for as long as its sender liked, and 400 of them passed the Helm
/// chart's 32 MiB memory limit.
pub const BUFFER_BUDGET: usize = 32 << 20;

/// The budget of read-buffer bytes past [`BASE_BUFFER`], shared by the agent's frames listeners.
#[derive(Debug, Clone)]
pub struct BufferBudget {
    kib: Arc<Semaphore>,
}

impl Default for BufferBudget {
    fn default() -> Self {
        Self::new(BUFFER_BUDGET)
    }
}

impl BufferBudget {
    /// A budget of `bytes` (in whole KiB).
    pub fn new(bytes: usize) -> Self {
        BufferBudget {
            kib: Arc::new(Semaphore::new(bytes / 1024)),
        }
    }

    /// What is left, in bytes.
    pub fn available(&self) -> usize {
        self.kib.available_permits() * 1024
    }
}

/// One connection's part of the budget: grown with its buffer, given back when the buffer is (and
/// when the connection ends).
#[derive(Debug)]
pub struct Charge {
    budget: BufferBudget,
    kib: u32,
}

impl Charge {
    /// Nothing charged yet.
    pub fn new(budget: BufferBudget) -> Self {
        Charge { budget, kib: 0 }
    }

    /// Makes the charge cover a buffer of `capacity` bytes; false when the budget cannot.
    pub fn cover(&mut self, capacity: usize) -> bool {
        let want = capacity.saturating_sub(BASE_BUFFER).div_ceil(1024) as u32;
        if want <= self.kib {
            return true;
        }
        match self.budget.kib.try_acquire_many(want - self.kib) {
            Ok(p) => {
                p.forget();
                self.kib = want;
                true
            }
            Err(_) => false,
        }
    }

    /// Gives everything back (the buffer went back to its base).
    pub fn release(&mut self) {
        if self.kib > 0 {
            self.budget.kib.add_permits(self.kib as usize);
            self.kib = 0;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_charged_past_the_base_and_given_back() {
        let budget = BufferBudget::new(64 * 1024);
        let mut a = Charge::new(budget.clone());
        assert!(a.cover(BASE_BUFFER));
        assert_eq!(budget.available(), 64 * 1024);
        assert!(a.cover(BASE_BUFFER + 40 * 1024));
        assert_eq!(budget.available(), 24 * 1024);
        let mut b = Charge::new(budget.clone());
        assert!(!b.cover(BASE_BUFFER + 30 * 1024), "past the budget");
        a.release();
        assert!(b.cover(BASE_BUFFER + 30 * 1024));
        drop(b);
        assert_eq!(budget.available(), 64 * 1024);
    }
}
