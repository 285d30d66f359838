//! `floodgate rules …`: the operators' command line for the rules API. Readable output by default,
//! `--json` for scripts; exit code 0 on success, 1 on a refused or failed request.
//!
//! `args` holds the subcommands; `api` the request to the server; one file per group of
//! subcommands: `files` (validate, diff, apply, import-envoy, with `code`, rules as code's load and
//! plan), `crud` (one rule, dry-run, audit), `overrides`, `penalties`; `print` the answers' text.

mod api;
mod args;
mod code;
mod crud;
mod files;
mod overrides;
mod penalties;
mod print;

use floodgate_rules_service::http;

pub use args::{RulesCli, RulesCommand};

/// Runs one CLI command; prints its result.
pub async fn run(cli: RulesCli) -> anyhow::Result<()> {
    http::configure(cli.ca.as_deref()).map_err(|e| anyhow::anyhow!("--ca: {e}"))?;
    let token = match &cli.token_file {
        Some(path) => Some(
            floodgate_rules_service::tokens::secret_from_file(path)
                .map_err(|e| anyhow::anyhow!("--token-file: {e}"))?,
        ),
        None => cli.token.clone(),
    };
    let api = api::Api {
        server: &cli.server,
        token: token.as_deref(),
    };
    let json = cli.json;
    match &cli.command {
        RulesCommand::Validate { files } => files::validate(files),
        RulesCommand::Diff {
            files,
            prune,
            exit_code,
        } => files::diff_or_apply(&api, files, *prune, false, *exit_code).await,
        RulesCommand::Apply { files, prune } => files::diff_or_apply(&api, files, *prune, true, false).await,
        RulesCommand::ImportEnvoy { files, dry_run } => {
            files::import_envoy(&api, files, *dry_run, json).await
        }
        RulesCommand::List => crud::list(&api, json).await,
        RulesCommand::Get { id } => crud::get(&api, id, json).await,
        RulesCommand::Put { id, file, if_match } => crud::put(&api, id, file, *if_match, json).await,
        RulesCommand::Delete { id, if_match } => crud::delete(&api, id, *if_match, json).await,
        RulesCommand::DryRun { id } => crud::dry_run(&api, id, json).await,
        RulesCommand::Audit { limit } => crud::audit(&api, *limit, json).await,
        RulesCommand::Override(o) => overrides::run(&api, o, json).await,
        RulesCommand::Penalty(p) => penalties::run(&api, p, json).await,
    }
}
