//! `floodgate`: one binary, several roles (`floodgate_agent::commands` has one file per command).

/// mimalloc instead of glibc's malloc: a check on the Redis path makes ~15 allocations, which cost
/// ~190 instructions each in glibc (malloc + free, its per-thread cache included) and ~85 in
/// mimalloc's per-thread free lists (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    floodgate_agent::commands::main()
}
