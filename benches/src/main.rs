//! `loadgen`: Floodgate's load generator and its same-run baselines.
//!
//! It starts what it measures as real processes — an echo server (the bare Unix-socket baseline), a
//! `redis-server`, a `floodgate agent` on the embedded store and one on Redis — then drives each
//! with a closed loop (C clients, D checks in flight each) and optionally an open loop (a fixed rate,
//! latency measured from each request's intended send time, so there is no coordinated omission).
//! It prints a table and writes JSON. See BENCHMARKS.md for the commands and figures.
//!
//! # Layout
//! - `closed`: the closed loop over any target.
//! - `open`: the open loop (blocking threads, intended-time latency).
//! - `echo`: the bare Unix-socket server used as the baseline.
//! - `targets`: connections to the echo server, an agent, and bare EVALSHA.
//! - `propagation`: a rule change's time to every agent (PUT → every agent enforcing).
//! - `fleet`: fleet scale (commands per check batched vs sync, over-admission with N agents,
//!   memory per key).
//! - `gateway`: the tower Layer's added latency over a bare axum handler; the agent path with
//!   metrics and events on vs off.
//! - `grpc`: Envoy's ShouldRateLimit over gRPC vs the frames protocol.
//! - `sdk`: the Rust SDK against a running agent (the Python and Node SDK benchmarks' baseline).
//! - `instructions`: instructions per check under callgrind, and where they go.
//! - `versus`: side by side: the agent's sync path vs rate-limiter-flexible vs bare EVALSHA.
//! - `core_path`: the default command's closed and open loops over the echo, EVALSHA and agents.
//! - `attacks`: hostile gRPC peers, one at a time, while honest gRPC and frames clients measure.
//! - `overload`: one agent's closed-loop capacity, then an open loop at multiples of it (shedding).
//! - `report`: percentiles, the table, the JSON.

mod attacks;
mod chaos;
mod closed;
mod core_path;
mod echo;
mod fleet;
mod gateway;
mod grpc;
mod instructions;
mod leases;
mod open;
mod overload;
mod overrides;
mod pairs;
mod propagation;
mod report;
mod reservations;
mod sdk;
mod targets;
mod versus;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// The rule every bench check uses: a limit so high that checks stay allowed, so each one does the
/// full read-compute-write work of the script.
pub(crate) const RULES: &str =
    r#"{"rules":[{"id":"bench","dimension":"user","limit":1000000000000,"windowSeconds":60}]}"#;

#[derive(Parser)]
#[command(name = "loadgen", about = "Floodgate load generator with same-run baselines")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: core_path::RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the bare Unix-socket baseline (used by loadgen itself).
    Echo {
        /// Socket path.
        #[arg(long)]
        socket: PathBuf,
    },
    /// The chaos scenario: a Redis outage under load, then an agent restart under load.
    Chaos {
        /// Checks/s offered (split over two agents).
        #[arg(long, default_value_t = 10_000)]
        rate: u64,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/chaos.json")]
        json: PathBuf,
        /// The agents' Redis timeout in ms (the agent's default is 5).
        #[arg(long, default_value_t = 5)]
        redis_timeout_ms: u64,
    },
    /// Redis commands per 1,000 checks, sync (coalescing off and on) vs batched, open loop.
    Commands {
        /// Offered checks/s for the batched rule.
        #[arg(long, default_value_t = 100_000)]
        rate: u64,
        /// Offered checks/s for the sync rule (what one agent's sync path sustains here).
        #[arg(long, default_value_t = 30_000)]
        sync_rate: u64,
        /// Distinct keys.
        #[arg(long, default_value_t = 10_000)]
        keys: usize,
        /// Seconds measured per mode (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 4.0)]
        seconds: f64,
        /// Connections the open loop spreads its requests over.
        #[arg(long, default_value_t = 4)]
        connections: usize,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/commands.json")]
        json: PathBuf,
    },
    /// Over-admission of a batched rule with N agents on one key offered twice its limit.
    Accuracy {
        /// Agent counts, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "4,8")]
        agents: Vec<usize>,
        /// The limit per 2 s window.
        #[arg(long, default_value_t = 2_000)]
        limit: u64,
        /// Whole windows measured.
        #[arg(long, default_value_t = 5)]
        windows: u64,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/accuracy.json")]
        json: PathBuf,
    },
    /// What rejected cross-shard checks leave behind (the take-back's residual over-count).
    Compensation {
        /// Two-item checks sent.
        #[arg(long, default_value_t = 20_000)]
        checks: u64,
        /// Concurrent clients.
        #[arg(long, default_value_t = 64)]
        clients: usize,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/compensation.json")]
        json: PathBuf,
    },
    /// Time from a rule PUT to every agent enforcing it, with the watch and without.
    Propagation {
        /// Agents following the rules service.
        #[arg(long, default_value_t = 4)]
        agents: usize,
        /// Rule changes measured.
        #[arg(long, default_value_t = 50)]
        changes: usize,
        /// The agents' poll interval for the run without a watch, in ms.
        #[arg(long, default_value_t = 1_000)]
        poll_ms: u64,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/propagation.json")]
        json: PathBuf,
    },
    /// The tower Layer's added latency per request over a bare axum handler (same run).
    Middleware {
        /// Runs (bare then layered each time).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Concurrent keep-alive HTTP clients.
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Seconds measured per side and run.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/middleware.json")]
        json: PathBuf,
    },
    /// The agent path's latency with metrics and rejection events on vs off (same run).
    Observability {
        /// Runs per scenario (on and off each time, alternating which goes first).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Closed-loop clients.
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Seconds measured per side and run.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Distinct keys.
        #[arg(long, default_value_t = 10_000)]
        keys: usize,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/observability.json")]
        json: PathBuf,
    },
    /// Key placement on independent shards and the keys that move when one node is added.
    Placement {
        /// Distinct keys.
        #[arg(long, default_value_t = 1_000_000)]
        keys: usize,
        /// Node counts before adding one, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "3,4,8")]
        nodes: Vec<usize>,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/placement.json")]
        json: PathBuf,
    },
    /// Envoy's ShouldRateLimit over gRPC vs the Rust SDK over the socket, same agent, same run.
    Grpc {
        /// Runs per level (alternating which side goes first).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Requests in flight (on one HTTP/2 channel, or one SDK client), comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        clients: Vec<usize>,
        /// Seconds measured per side and run (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Stores: memory, redis, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "memory,redis")]
        store: Vec<String>,
        /// The agent's gRPC server: native or tonic.
        #[arg(long, default_value = "native")]
        grpc_server: String,
        /// The agent's worker threads (its `--threads`).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/grpc.json")]
        json: PathBuf,
    },
    /// The Rust SDK's `allow` against an agent already running at `--socket` (the baseline of the
    /// Python and Node SDK benchmarks): p50/p99 and checks/s per concurrency level.
    Sdk {
        /// The agent's socket.
        #[arg(long)]
        socket: PathBuf,
        /// The rule every check names (keys are `user:0` … `user:9999`).
        #[arg(long, default_value = "bench")]
        rule: String,
        /// Concurrent callers on one client, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,16")]
        clients: Vec<usize>,
        /// Seconds measured per level (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/sdk.json")]
        json: PathBuf,
    },
    /// Instructions per check under callgrind (in-memory, Redis sync, cache hit) and where they go:
    /// each scenario's agent is warmed up, its counts zeroed, n checks sent, and the counts dumped.
    Instructions {
        /// n: checks counted per scenario (rounded down to a multiple of its clients).
        #[arg(long, default_value_t = 20_000)]
        checks: u64,
        /// Only the scenarios whose name contains this.
        #[arg(long, default_value = "")]
        only: String,
        /// Where callgrind's files go.
        #[arg(long, default_value_os_t = instructions::default_dir())]
        dir: PathBuf,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/instructions.json")]
        json: PathBuf,
        /// Run each agent with its decision ledger on (`--ledger`, written into `dir`): what the
        /// ledger costs a check.
        #[arg(long)]
        ledger: bool,
    },
    /// The agent's sync path vs rate-limiter-flexible (Node, ioredis) vs a bare EVALSHA on one
    /// redis-server: checks/s, p50/p99 and CPU per check of the agent and of the Node process.
    Versus {
        /// Runs (the sides' order reversed every other run).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Calls in flight, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        clients: Vec<usize>,
        /// Seconds measured per side, level and run (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// The Node benchmark's rate-limiter-flexible script (built by `npx tsc` in sdk-node).
        #[arg(long, default_value_os_t = versus::default_rlf())]
        rlf: PathBuf,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/versus.json")]
        json: PathBuf,
    },
    /// Hostile gRPC peers (zero window, SETTINGS flood, rapid reset, CONTINUATION flood, a flood of
    /// large calls), one at a time, while honest gRPC and frames clients measure p50/p99; the agent's
    /// RSS while each runs.
    Attacks {
        /// Runs of every attack.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Seconds each honest client measures per attack (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Only the attacks whose name contains this (the no-attack phase always runs).
        #[arg(long, default_value = "")]
        only: String,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/attacks.json")]
        json: PathBuf,
    },
    /// `attacks`' large flood, in a process of its own: 256 large ShouldRateLimit calls in flight.
    #[command(hide = true)]
    Flood {
        /// The agent's gRPC address.
        #[arg(long)]
        addr: std::net::SocketAddr,
        /// For how long.
        #[arg(long)]
        seconds: f64,
    },
    /// The seeded fault runner (issue 33): real Redis and agents writing decision ledgers, an open
    /// loop offered twice the rules' limits, faults drawn from each seed, and the checker's verdict
    /// per seed. Exit code 1 when a seed breaches the accuracy contract.
    Faults {
        /// First seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Seeds to run, from `seed` on.
        #[arg(long, default_value_t = 1)]
        seeds: u64,
        /// Seconds of load per seed.
        #[arg(long, default_value_t = 12)]
        seconds: u64,
        /// Agents.
        #[arg(long, default_value_t = 2)]
        agents: usize,
        /// Checks per second offered, over all agents.
        #[arg(long, default_value_t = 1_000)]
        rate: u64,
        /// Client keys per rule (25 at 1,000 checks/s offers each rule about twice its limit).
        #[arg(long, default_value_t = 25)]
        keys: u64,
        /// Where the counters live: `single` (one redis-server: kills, pauses, latency),
        /// `sentinel` (a master, a replica and a sentinel: failovers) or `cluster` (three masters:
        /// reshards under load).
        #[arg(long, default_value = "single")]
        deployment: String,
    },
    /// Past capacity: one Redis agent's closed-loop capacity, then an open loop at multiples of it
    /// on the same agent: answered p99 and the fail mode's share per level.
    Overload {
        /// Runs (each measures the capacity again).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Offered load as multiples of the capacity, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "0.5,1,1.5,3")]
        factors: Vec<f64>,
        /// Seconds measured per level (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Closed-loop connections for the capacity.
        #[arg(long, default_value_t = 64)]
        clients: usize,
        /// Connections the open loop spreads its requests over.
        #[arg(long, default_value_t = 8)]
        connections: usize,
        /// Distinct keys.
        #[arg(long, default_value_t = 10_000)]
        keys: usize,
        /// The agent's worker threads (its default is 1; 0: one per core).
        #[arg(long, default_value_t = 1)]
        agent_threads: usize,
        /// The rate the factors multiply, in checks/s, instead of the closed-loop capacity each run
        /// measures: the same offered rates for two builds (a build whose fail mode answers faster
        /// measures a higher capacity, and would be offered more).
        #[arg(long)]
        capacity: Option<f64>,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/overload.json")]
        json: PathBuf,
    },
    /// Concurrency rules: acquire+release against one sync check (same run, same agent), Redis
    /// round trips and CPU per pair, memory per key holding leases in Redis and in the agent.
    Leases {
        /// Concurrent callers, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,16")]
        clients: Vec<usize>,
        /// Runs per level (the sides' order alternates).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Seconds measured per side, level and run (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Keys holding leases for the memory figures.
        #[arg(long, default_value_t = 100_000)]
        keys: usize,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/leases.json")]
        json: PathBuf,
    },
    /// Reservations: reserve+commit against one sync check (same run, same agent), Redis calls and
    /// CPU per pair, and a budget's overshoot under 1,000 requests in flight on one key.
    Reservations {
        /// Concurrent callers, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,16")]
        clients: Vec<usize>,
        /// Runs per level and per way of spending (the latency sides' order alternates).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Seconds measured per side, level and run (after a quarter of that as warm-up).
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/reservations.json")]
        json: PathBuf,
    },
    /// Per-client overrides: PUT → every agent holding it (p50/p99), and an agent's memory per
    /// override held.
    Overrides {
        /// Agents following the rules service.
        #[arg(long, default_value_t = 4)]
        agents: usize,
        /// Overrides written and timed.
        #[arg(long, default_value_t = 50)]
        changes: usize,
        /// Overrides held for the memory figures, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
        held: Vec<usize>,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/overrides.json")]
        json: PathBuf,
    },
    /// Redis memory per tracked pair and agent RSS per batched key.
    Memory {
        /// Distinct keys.
        #[arg(long, default_value_t = 1_000_000)]
        keys: usize,
        /// Where to write the JSON report.
        #[arg(long, default_value = "target/bench/memory.json")]
        json: PathBuf,
    },
}

fn write_json(path: &std::path::Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(value)?)?;
    println!("JSON written to {}", path.display());
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::Echo { socket }) = cli.command {
        return echo::serve(&socket);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if let Some(Command::Chaos {
        rate,
        redis_timeout_ms,
        json,
    }) = cli.command
    {
        let report = runtime.block_on(chaos::run(rate, redis_timeout_ms))?;
        if let Some(parent) = json.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&json, serde_json::to_string_pretty(&report)?)?;
        println!("JSON written to {}", json.display());
        return Ok(());
    }
    match cli.command {
        Some(Command::Commands {
            rate,
            sync_rate,
            keys,
            seconds,
            connections,
            json,
        }) => {
            let rows = runtime.block_on(fleet::commands(rate, sync_rate, keys, seconds, connections))?;
            write_json(&json, &rows)
        }
        Some(Command::Accuracy {
            agents,
            limit,
            windows,
            json,
        }) => {
            let rows = runtime.block_on(fleet::accuracy(&agents, limit, windows))?;
            write_json(&json, &rows)
        }
        Some(Command::Compensation {
            checks,
            clients,
            json,
        }) => {
            let row = runtime.block_on(fleet::compensation(checks, clients))?;
            write_json(&json, &row)
        }
        Some(Command::Propagation {
            agents,
            changes,
            poll_ms,
            json,
        }) => {
            let rows = runtime.block_on(async {
                let watched = propagation::run(agents, changes, true, 30_000).await?;
                let polled = propagation::run(agents, changes, false, poll_ms).await?;
                anyhow::Ok(vec![watched, polled])
            })?;
            write_json(&json, &rows)
        }
        Some(Command::Middleware {
            runs,
            clients,
            seconds,
            json,
        }) => {
            let rows = runtime.block_on(gateway::middleware(runs, clients, seconds))?;
            write_json(&json, &rows)
        }
        Some(Command::Observability {
            runs,
            clients,
            seconds,
            keys,
            json,
        }) => {
            let rows = runtime.block_on(gateway::observability(runs, clients, seconds, keys))?;
            write_json(&json, &rows)
        }
        Some(Command::Grpc {
            runs,
            clients,
            seconds,
            store,
            grpc_server,
            threads,
            json,
        }) => {
            let agent = grpc::AgentArgs {
                server: grpc_server,
                threads,
            };
            let rows = runtime.block_on(grpc::run(runs, &clients, seconds, &store, &agent))?;
            write_json(&json, &rows)
        }
        Some(Command::Sdk {
            socket,
            rule,
            clients,
            seconds,
            json,
        }) => {
            let report = runtime.block_on(sdk::run(&socket, &rule, &clients, seconds))?;
            for r in &report.results {
                println!(
                    "rust sdk  clients {:>3}  p50 {:>8.1} µs  p99 {:>8.1} µs  {:>9.0} checks/s  {} by fail policy",
                    r.clients, r.p50_us, r.p99_us, r.checks_per_s, r.fail_policy
                );
            }
            write_json(&json, &report)
        }
        Some(Command::Placement { keys, nodes, json }) => {
            let rows: Vec<_> = nodes.iter().map(|&n| fleet::placement(keys, n)).collect();
            write_json(&json, &rows)
        }
        Some(Command::Instructions {
            checks,
            only,
            dir,
            json,
            ledger,
        }) => {
            let rows = runtime.block_on(instructions::run(checks, &only, &dir, ledger))?;
            write_json(&json, &rows)
        }
        Some(Command::Versus {
            runs,
            clients,
            seconds,
            rlf,
            json,
        }) => {
            let rows = runtime.block_on(versus::run(runs, &clients, seconds, &rlf))?;
            write_json(&json, &rows)
        }
        Some(Command::Attacks {
            runs,
            seconds,
            only,
            json,
        }) => {
            let rows = runtime.block_on(attacks::run(runs, seconds, &only))?;
            write_json(&json, &rows)
        }
        Some(Command::Flood { addr, seconds }) => runtime.block_on(attacks::flood(
            addr,
            std::time::Instant::now() + std::time::Duration::from_secs_f64(seconds),
        )),
        Some(Command::Faults {
            seed,
            seeds,
            seconds,
            agents,
            rate,
            keys,
            deployment,
        }) => {
            let deployment = match deployment.as_str() {
                "single" => floodgate_tests::faults::Deployment::Single,
                "sentinel" => floodgate_tests::faults::Deployment::Sentinel,
                "cluster" => floodgate_tests::faults::Deployment::Cluster,
                other => anyhow::bail!("--deployment {other}: single, sentinel or cluster"),
            };
            let mut breached = Vec::new();
            for seed in seed..seed + seeds {
                let plan = floodgate_tests::faults::Plan {
                    seed,
                    seconds,
                    agents,
                    rate,
                    keys,
                    deployment,
                };
                let report = runtime.block_on(floodgate_tests::faults::run(plan));
                println!("{}", report.text());
                if !report.judgement.breaches.is_empty() || !report.troubles.is_empty() {
                    breached.push(seed);
                }
            }
            if !breached.is_empty() {
                eprintln!("seeds that breached the contract: {breached:?}");
                std::process::exit(1);
            }
            Ok(())
        }
        Some(Command::Overload {
            runs,
            factors,
            seconds,
            clients,
            connections,
            keys,
            agent_threads,
            capacity,
            json,
        }) => {
            let report = runtime.block_on(overload::run(overload::Setup {
                runs,
                factors,
                seconds,
                clients,
                connections,
                keys,
                agent_threads,
                fixed: capacity,
            }))?;
            write_json(&json, &report)
        }
        Some(Command::Leases {
            clients,
            runs,
            seconds,
            keys,
            json,
        }) => {
            let report = runtime.block_on(leases::run(&clients, seconds, runs, keys))?;
            write_json(&json, &report)
        }
        Some(Command::Reservations {
            clients,
            runs,
            seconds,
            json,
        }) => {
            let report = runtime.block_on(reservations::run(&clients, seconds, runs))?;
            write_json(&json, &report)
        }
        Some(Command::Overrides {
            agents,
            changes,
            held,
            json,
        }) => {
            let report = runtime.block_on(overrides::run(agents, changes, &held))?;
            write_json(&json, &report)
        }
        Some(Command::Memory { keys, json }) => {
            let rows = runtime.block_on(fleet::memory(keys))?;
            write_json(&json, &rows)
        }
        _ => runtime.block_on(core_path::run(cli.run)),
    }
}

/// CPU time (user + system) a process has used, in clock ticks (1/100 s), from /proc.
pub(crate) fn cpu_ticks(pid: u32) -> Option<u64> {
    cpu_split(pid).map(|(user, sys)| user + sys)
}

/// A process's CPU so far in 10 ms ticks, split: (user space, kernel on its behalf).
pub(crate) fn cpu_split(pid: u32) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(") ")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After "pid (comm) ", utime and stime are the 12th and 13th fields.
    Some((
        fields.get(11)?.parse::<u64>().ok()?,
        fields.get(12)?.parse::<u64>().ok()?,
    ))
}
