//! `floodgate completions`, `floodgate man` and `floodgate config-table`: the command line, printed
//! for shells, for man and for docs/configuration.md.

use clap::Args;

use crate::config::AgentConfig;

/// Shell completions for `shell`.
pub(super) fn completions(cmd: &mut clap::Command, shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut out = Vec::new();
    clap_complete::generate(shell, cmd, "floodgate", &mut out);
    super::print_all(&out)
}

/// The man page, as roff.
pub(super) fn man(cmd: clap::Command) -> anyhow::Result<()> {
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut out)?;
    super::print_all(&out)
}

/// The Markdown table of the agent's settings.
pub(super) fn config_table() -> anyhow::Result<()> {
    let agent = AgentConfig::augment_args(clap::Command::new("agent"));
    super::print_all(crate::settings::table(&agent).as_bytes())
}
