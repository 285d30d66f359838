//! ARCHITECTURE.md checked against the code it describes, offline: every repository path it names in
//! backticks or links to exists, every function it names (`Type::method`, `crate::function`,
//! `fn name`, or a name right after its file's path) is defined in the repository's Rust sources,
//! every number it states that a constant defines is still that constant's value, and the page
//! stays short enough to read (at most 350 lines).
//!
//! The page writes paths from the repository root, so they are checked literally. A check here reads
//! text, never builds or runs anything, so it catches a renamed file, function or constant, not a
//! sentence that became false in some other way.

use std::path::{Path, PathBuf};

/// The repository root: the parent of this crate's directory (`tests/`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the repository")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn page() -> String {
    read(&repo_root().join("ARCHITECTURE.md"))
}

/// One inline code span: its text and where it starts and ends (the backticks included).
struct Span<'a> {
    text: &'a str,
    start: usize,
    end: usize,
}

/// The page's inline code spans, outside fenced code blocks.
fn spans(page: &str) -> Vec<Span<'_>> {
    let mut out = Vec::new();
    let mut offset = 0;
    let mut fenced = false;
    for line in page.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            let mut rest = 0;
            while let Some(open) = line[rest..].find('`') {
                let open = rest + open;
                let Some(len) = line[open + 1..].find('`') else {
                    break;
                };
                let close = open + 1 + len;
                out.push(Span {
                    text: &line[open + 1..close],
                    start: offset + open,
                    end: offset + close + 1,
                });
                rest = close + 1;
            }
        }
        offset += line.len();
    }
    out
}

const PATH_ENDINGS: [&str; 10] = [
    ".rs", ".lua", ".md", ".py", ".ts", ".toml", ".sh", ".json", ".yaml", "/",
];

/// A span that names a path in the repository: relative, one word, with a `/`, ending in a source
/// or documentation file's extension or in `/` (a folder).
fn is_repo_path(text: &str) -> bool {
    text.contains('/')
        && !text.starts_with('/')
        && !text.starts_with('$')
        && !text.contains(char::is_whitespace)
        && PATH_ENDINGS.iter().any(|end| text.ends_with(end))
}

/// Every `.rs` file of the repository (the build output and VCS data left out), with its text.
fn rust_sources() -> Vec<(PathBuf, String)> {
    let root = repo_root();
    let mut files = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(d) = dirs.pop() {
        let entries = std::fs::read_dir(&d).unwrap_or_else(|e| panic!("read {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !matches!(name, "target" | "node_modules") && !name.starts_with('.') {
                    dirs.push(path);
                }
            } else if name.ends_with(".rs") {
                let text = read(&path);
                files.push((path, text));
            }
        }
    }
    files
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

fn is_type_name(s: &str) -> bool {
    is_ident(s) && s.starts_with(|c: char| c.is_ascii_uppercase())
}

fn is_fn_name(s: &str) -> bool {
    is_ident(s) && s.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
}

/// Whether `word` occurs in `text` right after `before`, not followed by more of an identifier.
fn has_word_after(text: &str, before: &str, word: &str, next_ok: impl Fn(char) -> bool) -> bool {
    let needle = format!("{before}{word}");
    text.match_indices(&needle)
        .any(|(i, _)| text[i + needle.len()..].chars().next().is_some_and(&next_ok))
}

/// Whether `text` defines a function `name` (`fn name(` or `fn name<`).
fn defines_fn(text: &str, name: &str) -> bool {
    has_word_after(text, "fn ", name, |c| c == '(' || c == '<')
}

/// Whether `text` implements or declares the type `ty` (`impl Ty`, `impl<…> Ty`, `for Ty`, `trait Ty`).
fn has_impl_of(text: &str, ty: &str) -> bool {
    let not_ident = |c: char| !(c.is_ascii_alphanumeric() || c == '_');
    ["impl ", "> ", "for ", "trait "]
        .iter()
        .any(|before| has_word_after(text, before, ty, not_ident))
}

/// What a function span names: the function, and the type whose impl holds it, if one is named.
/// `Type::method`, `crate::module::function` and `fn name` are function spans; others are not.
fn function_named(text: &str) -> Option<(Option<&str>, &str)> {
    if let Some(name) = text.strip_prefix("fn ") {
        return is_fn_name(name).then_some((None, name));
    }
    let parts: Vec<&str> = text.split("::").collect();
    if parts.len() < 2 || !parts.iter().all(|p| is_ident(p)) {
        return None;
    }
    let name = *parts.last()?;
    if !is_fn_name(name) {
        return None;
    }
    let owner = parts[parts.len() - 2];
    Some((is_type_name(owner).then_some(owner), name))
}

#[test]
fn the_page_is_short_enough_to_read() {
    let lines = page().lines().count();
    assert!(
        lines <= 350,
        "ARCHITECTURE.md has {lines} lines; it is a newcomer's map, at most 350"
    );
}

#[test]
fn every_path_the_page_names_exists() {
    let page = page();
    let root = repo_root();
    let mut named: Vec<String> = spans(&page)
        .iter()
        .filter(|s| is_repo_path(s.text))
        .map(|s| s.text.to_string())
        .collect();
    // Markdown links to files in the repository, too.
    for (i, _) in page.match_indices("](") {
        let target = &page[i + 2..];
        let target = &target[..target.find(')').expect("a link closes")];
        let target = target.split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") {
            named.push(target.to_string());
        }
    }
    named.sort();
    named.dedup();
    let missing: Vec<&String> = named.iter().filter(|p| !root.join(p.as_str()).exists()).collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:?}"
    );
    // The page is a map: if this many paths stopped being recognised, the check broke, not the page.
    assert!(
        named.len() >= 80,
        "only {} paths recognised in ARCHITECTURE.md: {named:?}",
        named.len()
    );
}

#[test]
fn every_function_the_page_names_is_defined() {
    let page = page();
    let sources = rust_sources();
    let mut missing = Vec::new();
    let mut checked = 0;
    for span in spans(&page) {
        let Some((owner, name)) = function_named(span.text) else {
            continue;
        };
        checked += 1;
        let found = sources
            .iter()
            .any(|(_, text)| defines_fn(text, name) && owner.is_none_or(|ty| has_impl_of(text, ty)));
        if !found {
            missing.push(span.text);
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names functions no .rs file defines: {missing:?}"
    );
    assert!(
        checked >= 15,
        "only {checked} functions recognised in ARCHITECTURE.md"
    );
}

/// "`core/src/engine/check.rs` `Engine::check_received`": a name written right after its file's path
/// is a function that file defines (inside that type's impl, when a type is named).
#[test]
fn a_function_named_after_its_file_is_in_that_file() {
    let page = page();
    let root = repo_root();
    let spans = spans(&page);
    let mut wrong = Vec::new();
    let mut checked = 0;
    for pair in spans.windows(2) {
        let (file, name) = (&pair[0], &pair[1]);
        if !file.text.ends_with(".rs")
            || !is_repo_path(file.text)
            || !page[file.end..name.start].trim().is_empty()
        {
            continue;
        }
        let (owner, function) = if is_fn_name(name.text) {
            (None, name.text)
        } else if let Some(named) = function_named(name.text) {
            named
        } else {
            continue;
        };
        checked += 1;
        let text = read(&root.join(file.text));
        if !defines_fn(&text, function) || owner.is_some_and(|ty| !has_impl_of(&text, ty)) {
            wrong.push(format!("{} {}", file.text, name.text));
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md puts functions in files that do not define them: {wrong:?}"
    );
    assert!(
        checked >= 15,
        "only {checked} file-and-function pairs recognised in ARCHITECTURE.md"
    );
}

/// A number the page states and the constant that defines it: the page must say `says` (line breaks
/// read as spaces), and the first line of `file` containing `anchor` must contain `value`.
struct Fact {
    says: &'static str,
    file: &'static str,
    anchor: &'static str,
    value: &'static str,
}

const FACTS: &[Fact] = &[
    Fact {
        says: "Floodgate 0.6.0",
        file: "Cargo.toml",
        anchor: "version = \"",
        value: "\"0.6.0\"",
    },
    Fact {
        says: "protocol version 6",
        file: "protocol/src/limits.rs",
        anchor: "const VERSION:",
        value: "= 6;",
    },
    Fact {
        says: "oldest spoken 1",
        file: "protocol/src/limits.rs",
        anchor: "const MIN_VERSION:",
        value: "= 1;",
    },
    Fact {
        says: "at most 16 items",
        file: "protocol/src/limits.rs",
        anchor: "const MAX_ITEMS:",
        value: "= 16;",
    },
    Fact {
        says: "4,096 connections by default",
        file: "agent/src/server/cap.rs",
        anchor: "const DEFAULT_MAX_CONNECTIONS:",
        value: "= 4_096;",
    },
    Fact {
        says: "past 8 KiB",
        file: "agent/src/server/cap.rs",
        anchor: "const BASE_BUFFER:",
        value: "= 8 * 1024;",
    },
    Fact {
        says: "32 MiB budget",
        file: "agent/src/server/cap.rs",
        anchor: "const BUFFER_BUDGET:",
        value: "= 32 << 20;",
    },
    Fact {
        says: "idle after 300 s",
        file: "agent/src/server/connection.rs",
        anchor: "const DEFAULT_IDLE_TIMEOUT:",
        value: "from_secs(300)",
    },
    Fact {
        says: "unfinished after 2 s",
        file: "agent/src/server/connection.rs",
        anchor: "const DEFAULT_FRAME_TIMEOUT:",
        value: "from_secs(2)",
    },
    Fact {
        says: "at most 4,096 in flight",
        file: "agent/src/server/connection.rs",
        anchor: "const MAX_IN_FLIGHT:",
        value: "= 4096;",
    },
    Fact {
        says: "store timeout (5 ms by default)",
        file: "agent/src/config.rs",
        anchor: "FLOODGATE_REDIS_TIMEOUT_MS",
        value: "default_value_t = 5,",
    },
    Fact {
        says: "at most 2 calls in flight per group",
        file: "redis/src/store/coalesce.rs",
        anchor: "const MAX_IN_FLIGHT:",
        value: "= 2;",
    },
    Fact {
        says: "`--coalesce`, 64 items",
        file: "redis/src/store/mod.rs",
        anchor: "const DEFAULT_COALESCE:",
        value: "= 64;",
    },
    Fact {
        says: "in the last 3 s",
        file: "core/src/guard/recent.rs",
        anchor: "const REPLAY_MS:",
        value: "= 3_000;",
    },
    Fact {
        says: "each flush slot (100 ms by default)",
        file: "core/src/batch/batcher.rs",
        anchor: "const DEFAULT_FLUSH_MS:",
        value: "= 100;",
    },
    Fact {
        says: "refreshes the fail-closed list every 10 s",
        file: "sdk/src/connection.rs",
        anchor: "const FAIL_MODES_EVERY:",
        value: "from_secs(10)",
    },
    Fact {
        says: "after each HelloOk and every 10 s",
        file: "sdk-python/src/floodgate/fail_modes.py",
        anchor: "REFRESH_EVERY =",
        value: "= 10.0",
    },
    Fact {
        says: "after each HelloOk and every 10 s",
        file: "sdk-node/src/client.ts",
        anchor: "const FAIL_MODES_EVERY_MS =",
        value: "= 10_000;",
    },
    Fact {
        says: "asked every 100 ms",
        file: "redis/src/sentinel.rs",
        anchor: "const WATCH_EVERY:",
        value: "from_millis(100)",
    },
    Fact {
        says: "a yield every 500 µs",
        file: "h2/src/conn.rs",
        anchor: "const TURN:",
        value: "from_micros(500)",
    },
    Fact {
        says: "`MemoryStore` (64 shards)",
        file: "core/src/store/memory.rs",
        anchor: "const SHARDS:",
        value: "= 64;",
    },
    Fact {
        says: "rejection cache (64 shards",
        file: "core/src/cache.rs",
        anchor: "const SHARDS:",
        value: "= 64;",
    },
    Fact {
        says: "9 arguments per item",
        file: "lua/check.lua",
        anchor: "if #ARGV %",
        value: "% 9 ~= 0",
    },
];

#[test]
fn every_number_the_page_states_is_its_constants_value() {
    let page = page().split_whitespace().collect::<Vec<_>>().join(" ");
    let root = repo_root();
    let mut wrong = Vec::new();
    for fact in FACTS {
        if !page.contains(fact.says) {
            wrong.push(format!("the page no longer says {:?}", fact.says));
            continue;
        }
        let text = read(&root.join(fact.file));
        match text.lines().find(|line| line.contains(fact.anchor)) {
            Some(line) if line.contains(fact.value) => {}
            Some(line) => wrong.push(format!(
                "the page says {:?} but {} has {:?}",
                fact.says,
                fact.file,
                line.trim()
            )),
            None => wrong.push(format!("{} has no line with {:?}", fact.file, fact.anchor)),
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's numbers and the code disagree:\n{}",
        wrong.join("\n")
    );
}
