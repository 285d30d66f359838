//! The agent's config file: a TOML table whose keys are the agent's flags (`redis_timeout_ms = 5`
//! for `--redis-timeout-ms`), read as the flags' defaults so that environment variables and flags
//! still override it; the documentation table generated from the same clap definitions; and what a
//! reload (SIGHUP) may change at run time.

use std::ffi::OsString;

/// Keys a SIGHUP applies at run time; every other changed key is reported as needing a restart.
pub const RELOADABLE: [&str; 3] = ["flush_interval_ms", "log", "rules"];

/// The config file named by `--config FILE` / `--config=FILE` among `args`, else by
/// `FLOODGATE_CONFIG`.
pub fn config_path(args: &[OsString]) -> Option<std::path::PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let a = a.to_string_lossy();
        if a == "--config" {
            return it.next().map(std::path::PathBuf::from);
        }
        if let Some(v) = a.strip_prefix("--config=") {
            return Some(v.into());
        }
    }
    std::env::var_os("FLOODGATE_CONFIG").map(Into::into)
}

/// `cmd` with the file's values as its arguments' defaults. Unknown keys, `config` itself and values
/// that are not strings, numbers, booleans or arrays of them are refused, naming the key.
pub fn apply_file(mut cmd: clap::Command, text: &str) -> Result<clap::Command, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| format!("config file: {e}"))?;
    for (key, value) in table {
        let id = key.replace('-', "_");
        if id == "config" || !cmd.get_arguments().any(|a| a.get_id() == id.as_str()) {
            let keys: Vec<String> = keys(&cmd).into_iter().filter(|k| k != "config").collect();
            return Err(format!(
                "config file: unknown key {key:?}; keys are {}",
                keys.join(", ")
            ));
        }
        let text = scalar(&value)
            .or_else(|| {
                value.as_array().map(|a| {
                    a.iter()
                        .map(scalar)
                        .collect::<Option<Vec<_>>>()
                        .map(|v| v.join(","))
                })?
            })
            .ok_or_else(|| {
                format!("config file: {key} must be a string, number, boolean or a list of them")
            })?;
        cmd = cmd.mut_arg(id, |a| a.default_value(text));
    }
    Ok(cmd)
}

fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The config keys of a command: its long flags in snake case.
pub fn keys(cmd: &clap::Command) -> Vec<String> {
    cmd.get_arguments()
        .filter(|a| a.get_long().is_some())
        .map(|a| a.get_id().as_str().to_string())
        .collect()
}

/// The Markdown table of every setting: file key, flag, environment variable, default, meaning.
pub fn table(cmd: &clap::Command) -> String {
    let mut out =
        String::from("| file key | flag | environment | default | meaning |\n|---|---|---|---|---|\n");
    for a in cmd.get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        let env = a
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let defaults: Vec<String> = a
            .get_default_values()
            .iter()
            .map(|d| d.to_string_lossy().into_owned())
            .collect();
        let default = if defaults.is_empty() {
            "none".to_string()
        } else {
            format!("`{}`", defaults.join(","))
        };
        let help = a
            .get_help()
            .map(|h| h.to_string())
            .unwrap_or_default()
            .replace('\n', " ")
            .replace('|', "\\|");
        let reload = if RELOADABLE.contains(&a.get_id().as_str()) {
            " *(reloaded on SIGHUP)*"
        } else {
            ""
        };
        out.push_str(&format!(
            "| `{}` | `--{long}` | {env} | {default} | {help}{reload} |\n",
            a.get_id()
        ));
    }
    out
}

/// The keys whose values differ between two parses of the same command (a reload's changes).
pub fn changed(cmd: &clap::Command, old: &clap::ArgMatches, new: &clap::ArgMatches) -> Vec<String> {
    cmd.get_arguments()
        .map(|a| a.get_id().as_str())
        .filter(|id| {
            let raw = |m: &clap::ArgMatches| {
                m.try_get_raw(id)
                    .ok()
                    .flatten()
                    .map(|v| v.map(|s| s.to_os_string()).collect::<Vec<_>>())
            };
            raw(old) != raw(new)
        })
        .map(String::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, FromArgMatches};

    fn agent() -> clap::Command {
        crate::config::AgentConfig::augment_args(clap::Command::new("agent"))
    }

    fn parse(cmd: clap::Command, args: &[&str]) -> crate::config::AgentConfig {
        let m = cmd
            .try_get_matches_from(std::iter::once("agent").chain(args.iter().copied()))
            .unwrap();
        crate::config::AgentConfig::from_arg_matches(&m).unwrap()
    }

    #[test]
    fn the_file_sets_defaults_and_flags_override_it() {
        let cmd = apply_file(
            agent(),
            "redis_timeout_ms = 7\nsocket = \"/run/fg.sock\"\nmetrics = false\naccuracy = 0.1\nflush-interval-ms = 50\n",
        )
        .unwrap();
        let c = parse(cmd.clone(), &[]);
        assert_eq!(
            (c.redis_timeout_ms, c.metrics, c.accuracy, c.flush_interval_ms),
            (7, false, 0.1, 50)
        );
        assert_eq!(c.socket, Some(std::path::PathBuf::from("/run/fg.sock")));
        let c = parse(cmd, &["--redis-timeout-ms", "9"]);
        assert_eq!(c.redis_timeout_ms, 9, "a flag beats the file");
    }

    #[test]
    fn bad_files_are_refused_naming_the_key() {
        for (text, needle) in [
            ("redis_timeout = 5\n", "unknown key \"redis_timeout\""),
            ("config = \"x\"\n", "unknown key"),
            ("socket = { a = 1 }\n", "socket must be"),
            ("socket = \n", "config file"),
        ] {
            let e = apply_file(agent(), text).unwrap_err();
            assert!(e.contains(needle), "{e:?} should mention {needle:?}");
        }
        // A value of the wrong type is refused by the flag's own parser, naming it.
        let cmd = apply_file(agent(), "redis_timeout_ms = \"soon\"\n").unwrap();
        let e = cmd
            .try_get_matches_from(["agent"])
            .map(|m| crate::config::AgentConfig::from_arg_matches(&m).map(|_| ()))
            .and_then(|r| r)
            .unwrap_err()
            .to_string();
        assert!(e.contains("redis-timeout-ms"), "{e}");
    }

    #[test]
    fn the_table_has_every_flag_once() {
        let t = table(&agent());
        for key in keys(&agent()) {
            assert_eq!(t.matches(&format!("| `{key}` |")).count(), 1, "{key}");
        }
        assert!(t.contains(
            "| `flush_interval_ms` | `--flush-interval-ms` | `FLOODGATE_FLUSH_INTERVAL_MS` | `100` |"
        ));
    }

    /// docs/configuration.md's table is this module's output (`floodgate config-table` prints it).
    #[test]
    fn the_configuration_page_has_the_generated_table() {
        let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md"))
            .unwrap();
        let start = page.find("<!-- agent-config:start -->\n").expect("start marker") + 28;
        let end = page.find("<!-- agent-config:end -->").expect("end marker");
        assert_eq!(
            &page[start..end],
            table(&agent()),
            "docs/configuration.md's table is stale: paste `floodgate config-table` between its markers"
        );
    }

    #[test]
    fn changes_are_found_per_key() {
        let cmd = agent();
        let a = cmd
            .clone()
            .try_get_matches_from(["agent", "--redis-timeout-ms", "5"])
            .unwrap();
        let b = cmd
            .clone()
            .try_get_matches_from(["agent", "--redis-timeout-ms", "6", "--flush-interval-ms", "100"])
            .unwrap();
        assert_eq!(changed(&cmd, &a, &b), vec!["redis_timeout_ms".to_string()]);
    }
}
