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
        }
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
}

/// A same-run ratio the targets are stated in.
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

    fn compute_ratios(&mut self) {
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

    /// Prints the table and the ratios.
    pub fn print(&mut self) {
        self.compute_ratios();
        println!(
            "\n{:<22} {:>6} {:>7} {:>5} {:>11} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}",
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
            "redis µs/"
        );
        println!(
            "{:<22} {:>6} {:>7} {:>5} {:>11} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}",
            "", "", "", "", "", "", "", "", "", "check", "check"
        );
        for r in &self.rows {
            let (cmds, cpu) = match r.redis {
                Some(d) if r.all_checks > 0 && d.evalsha > 0 => (
                    format!("{:.2}", d.evalsha as f64 / r.all_checks as f64),
                    format!("{:.2}", d.evalsha_usec as f64 / r.all_checks as f64),
                ),
                _ => ("-".into(), "-".into()),
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
                "{:<22} {:>6} {:>7} {:>5} {:>11.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10} {:>10}{}",
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

    /// The rows and ratios as JSON.
    pub fn json(&self) -> anyhow::Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }
}
