//! Percentiles, the printed table with same-run ratios, and the JSON.

use serde::Serialize;

use crate::closed::LoopResult;
use crate::targets::RedisDelta;

/// One measured scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What was measured.
    pub scenario: String,
    /// `closed` or `open`.
    pub mode: &'static str,
    /// Connections.
    pub clients: usize,
    /// Checks in flight per client (closed loop).
    pub pipeline: usize,
    /// Offered checks/s (open loop).
    pub offered_per_s: Option<u64>,
    /// Answered checks/s.
    pub throughput_per_s: f64,
    /// Latency percentiles in µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Largest, µs.
    pub max_us: f64,
    /// Checks measured.
    pub checks: u64,
    /// Checks answered in all, warm-up included.
    pub all_checks: u64,
    /// Redis work during the scenario (closed loop).
    pub redis: Option<RedisDelta>,
    /// Share of measured checks the agent answered from its fail mode (store late or away), %.
    pub fallback_pct: f64,
    /// CPU the server process (agent or echo) used per check, µs (from /proc, 10 ms ticks).
    pub server_cpu_us_per_check: Option<f64>,
    /// The kernel's part of it (system time: socket reads and writes, epoll, wake-ups), µs.
    pub server_sys_us_per_check: Option<f64>,
}

fn us(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1_000.0
}

impl Row {
    /// A closed-loop row.
    pub fn closed(
        name: &str,
        clients: usize,
        pipeline: usize,
        r: LoopResult,
        redis: Option<RedisDelta>,
    ) -> Self {
        Row {
            scenario: name.into(),
            mode: "closed",
            clients,
            pipeline,
            offered_per_s: None,
            throughput_per_s: r.checks as f64 / r.elapsed.as_secs_f64(),
            p50_us: us(&r.hist, 0.5),
            p99_us: us(&r.hist, 0.99),
            p999_us: us(&r.hist, 0.999),
            max_us: r.hist.max() as f64 / 1_000.0,
            checks: r.checks,
            all_checks: r.all_checks,
            redis,
            server_cpu_us_per_check: None,
            server_sys_us_per_check: None,
            fallback_pct: if r.checks > 0 {
                r.fallbacks as f64 * 100.0 / r.checks as f64
            } else {
                0.0
            },
        }
    }

    /// Records the server process's CPU ticks over the whole scenario (warm-up included): user
    /// space and kernel.
    pub fn set_process_cpu(&mut self, ticks: Option<(u64, u64)>) {
        let per_check = |t: u64| t as f64 * 10_000.0 / self.all_checks as f64;
        let ticks = ticks.filter(|_| self.all_checks > 0);
        self.server_cpu_us_per_check = ticks.map(|(user, sys)| per_check(user + sys));
        self.server_sys_us_per_check = ticks.map(|(_, sys)| per_check(sys));
    }

    /// An open-loop row.
    pub fn open(name: &str, rate: u64, connections: usize, r: LoopResult) -> Self {
        let mut row = Row::closed(name, connections, 0, r, None);
        row.mode = "open";
        row.offered_per_s = Some(rate);
        row
    }
}

/// All rows of a run.
#[derive(Debug, Default, Serialize)]
pub struct Table {
    rows: Vec<Row>,
    ratios: Vec<Ratio>,
    runs: usize,
}

/// A ratio to a same-run baseline: the form the performance targets are stated in.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    clients: usize,
    what: String,
    value: f64,
    target: f64,
}

impl Table {
    /// Adds a row.
    pub fn push(&mut self, row: Row) {
        println!(
            "  measured {:<22} {:>6} {:>3} clients: {:>9.0} checks/s, p99 {:>8.1} µs",
            row.scenario, row.mode, row.clients, row.throughput_per_s, row.p99_us
        );
        self.rows.push(row);
    }

    fn find(&self, scenario: &str, clients: usize) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.scenario == scenario && r.clients == clients && r.mode == "closed")
    }

    /// Computes the same-run ratios from the rows.
    pub fn compute_ratios(&mut self) {
        let mut ratios = Vec::new();
        let mut clients: Vec<usize> = self.rows.iter().map(|r| r.clients).collect();
        clients.sort_unstable();
        clients.dedup();
        for c in clients {
            let uds = self.find("bare uds round trip", c);
            let eval = self.find("bare EVALSHA", c);
            if let (Some(m), Some(u)) = (self.find("agent, in-memory", c), uds) {
                ratios.push(Ratio {
                    clients: c,
                    what: "in-memory p99 / bare uds p99".into(),
                    value: m.p99_us / u.p99_us,
                    target: 2.0,
                });
            }
            if let (Some(r), Some(u), Some(e)) = (self.find("agent, redis", c), uds, eval) {
                ratios.push(Ratio {
                    clients: c,
                    what: "redis p99 / (bare uds p99 + bare EVALSHA p99)".into(),
                    value: r.p99_us / (u.p99_us + e.p99_us),
                    target: 1.5,
                });
            }
        }
        self.ratios = ratios;
    }

    /// Prints the table and the ratios (medians of `runs` runs).
    pub fn print(&mut self) {
        if self.ratios.is_empty() {
            self.compute_ratios();
        }
        println!("\nmedians of {} run(s):", self.runs.max(1));
        println!(
            "\n{:<22} {:>6} {:>7} {:>5} {:>11} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9}",
            "scenario",
            "mode",
            "clients",
            "depth",
            "checks/s",
            "p50 µs",
            "p99 µs",
            "p999 µs",
            "max µs",
            "EVALSHA/",
            "redis µs/",
            "redis CPU",
            "server µs/",
            "of it sys",
            "fallback"
        );
        println!(
            "{:<22} {:>6} {:>7} {:>5} {:>11} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9}",
            "", "", "", "", "", "", "", "", "", "check", "check", "µs/check", "check", "µs/check", "%"
        );
        for r in &self.rows {
            let (cmds, cpu, proc_cpu) = match r.redis {
                Some(d) if r.all_checks > 0 && d.evalsha > 0 => (
                    format!("{:.2}", d.evalsha as f64 / r.all_checks as f64),
                    format!("{:.2}", d.evalsha_usec as f64 / r.all_checks as f64),
                    format!("{:.2}", d.process_ticks as f64 * 10_000.0 / r.all_checks as f64),
                ),
                _ => ("-".into(), "-".into(), "-".into()),
            };
            let depth = if r.mode == "open" {
                "-".to_string()
            } else {
                r.pipeline.to_string()
            };
            let offered = r
                .offered_per_s
                .map(|o| format!(" (offered {o}/s)"))
                .unwrap_or_default();
            println!(
                "{:<22} {:>6} {:>7} {:>5} {:>11.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9.2}{}",
                r.scenario,
                r.mode,
                r.clients,
                depth,
                r.throughput_per_s,
                r.p50_us,
                r.p99_us,
                r.p999_us,
                r.max_us,
                cmds,
                cpu,
                proc_cpu,
                r.server_cpu_us_per_check
                    .map(|c| format!("{c:.2}"))
                    .unwrap_or_else(|| "-".into()),
                r.server_sys_us_per_check
                    .map(|c| format!("{c:.2}"))
                    .unwrap_or_else(|| "-".into()),
                r.fallback_pct,
                offered
            );
        }
        if !self.ratios.is_empty() {
            println!("\nratios (same run):");
            for q in &self.ratios {
                let verdict = if q.value <= q.target { "within" } else { "OVER" };
                println!(
                    "  {:>3} clients  {:<46} {:>6.2}  ({verdict} target {:.1})",
                    q.clients, q.what, q.value, q.target
                );
            }
        }
    }

    /// The median of several runs of the same scenarios: each figure is the median of that figure
    /// over the runs, and each ratio the median of the per-run ratios.
    pub fn median(tables: &[Table]) -> Table {
        let Some(first) = tables.first() else {
            return Table::default();
        };
        let same = |a: &Row, b: &Row| {
            a.scenario == b.scenario && a.mode == b.mode && a.clients == b.clients && a.pipeline == b.pipeline
        };
        let mut out = Table::default();
        for row in &first.rows {
            let runs: Vec<&Row> = tables
                .iter()
                .filter_map(|t| t.rows.iter().find(|r| same(r, row)))
                .collect();
            let med = |f: &dyn Fn(&Row) -> f64| median(runs.iter().map(|r| f(r)).collect());
            let mut m = row.clone();
            m.throughput_per_s = med(&|r| r.throughput_per_s);
            m.p50_us = med(&|r| r.p50_us);
            m.p99_us = med(&|r| r.p99_us);
            m.p999_us = med(&|r| r.p999_us);
            m.max_us = med(&|r| r.max_us);
            m.checks = med(&|r| r.checks as f64) as u64;
            m.all_checks = med(&|r| r.all_checks as f64) as u64;
            m.fallback_pct = med(&|r| r.fallback_pct);
            if m.server_cpu_us_per_check.is_some() {
                m.server_cpu_us_per_check = Some(med(&|r| r.server_cpu_us_per_check.unwrap_or(0.0)));
                m.server_sys_us_per_check = Some(med(&|r| r.server_sys_us_per_check.unwrap_or(0.0)));
            }
            if let Some(d) = &mut m.redis {
                let per = |f: &dyn Fn(&RedisDelta) -> u64| {
                    median(
                        runs.iter()
                            .filter_map(|r| r.redis.map(|x| f(&x) as f64 / r.all_checks.max(1) as f64))
                            .collect(),
                    )
                };
                // Stored back as totals for the median check count, so per-check columns stay right.
                let n = m.all_checks as f64;
                d.calls = (per(&|x| x.calls) * n) as u64;
                d.evalsha = (per(&|x| x.evalsha) * n) as u64;
                d.evalsha_usec = (per(&|x| x.evalsha_usec) * n) as u64;
                d.process_ticks = (per(&|x| x.process_ticks) * n) as u64;
            }
            out.rows.push(m);
        }
        let mut per_run: Vec<Vec<Ratio>> = tables
            .iter()
            .map(|t| {
                let mut t = Table {
                    rows: t.rows.clone(),
                    ratios: Vec::new(),
                    runs: 1,
                };
                t.compute_ratios();
                t.ratios
            })
            .collect();
        out.compute_ratios();
        for q in &mut out.ratios {
            let values: Vec<f64> = per_run
                .iter_mut()
                .filter_map(|rs| {
                    rs.iter()
                        .find(|r| r.clients == q.clients && r.what == q.what)
                        .map(|r| r.value)
                })
                .collect();
            q.value = median(values);
        }
        out.runs = tables.len();
        out
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The JSON: the medians and every run.
pub fn json(median: &Table, runs: &[Table]) -> anyhow::Result<String> {
    #[derive(Serialize)]
    struct Out<'a> {
        median: &'a Table,
        runs: &'a [Table],
    }
    Ok(serde_json::to_string_pretty(&Out { median, runs })?)
}
