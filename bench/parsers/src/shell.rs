//! The shell reader: ours (`taskbox_policy::shell::parse`) against tree-sitter-bash walked to
//! the same reading, on every shell string of our tests and on tricky and hostile cases.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};
use taskbox_policy::commands::quote;
use taskbox_policy::shell::{self, Word};

use crate::probe;
use crate::timing::{self, Timing};
use crate::ts_bash;

/// One input of the corpus.
pub struct Case {
    pub name: String,
    pub source: String,
    pub text: String,
    /// Generated hostile input: read in a child process, so that a crash is reported, not
    /// suffered.
    pub hostile: bool,
}

/// A reading, rendered for comparison: each command as the policy shows it (`<?>` for a word
/// known only at run time, `<?>/git` when its last path part is known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    pub commands: Vec<String>,
    pub unsure: bool,
    pub why: Vec<String>,
}

impl Shown {
    fn to_json(&self) -> Value {
        json!({"commands": self.commands, "unsure": self.unsure, "why": self.why})
    }

    fn from_json(v: &Value) -> Option<Shown> {
        Some(Shown {
            commands: v["commands"]
                .as_array()?
                .iter()
                .filter_map(|c| c.as_str().map(str::to_owned))
                .collect(),
            unsure: v["unsure"].as_bool()?,
            why: v["why"]
                .as_array()?
                .iter()
                .filter_map(|c| c.as_str().map(str::to_owned))
                .collect(),
        })
    }

    fn brief(&self) -> String {
        let mut s = format!("{:?}", self.commands);
        if s.len() > 300 {
            s = format!(
                "{} commands, first {:?}",
                self.commands.len(),
                self.commands.first()
            );
        }
        if self.unsure {
            let why = self.why.join("; ");
            let why: String = why.chars().take(160).collect();
            s.push_str(&format!(" unsure ({why})"));
        }
        s
    }
}

fn render(commands: &[Vec<Word>], why: Vec<String>) -> Shown {
    Shown {
        commands: commands
            .iter()
            .map(|c| {
                c.iter()
                    .map(|w| match w {
                        Word::Lit(s) => quote(s),
                        Word::One { base: Some(b) } => format!("<?>/{b}"),
                        Word::One { base: None } | Word::Many => "<?>".to_owned(),
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect(),
        unsure: !why.is_empty(),
        why,
    }
}

pub fn ours(src: &str) -> Shown {
    let s = shell::parse(src);
    render(&s.commands, s.unsure)
}

pub fn tree_sitter(parser: &mut tree_sitter::Parser, src: &str) -> Shown {
    let r = ts_bash::read(parser, src);
    render(&r.commands, r.unsure)
}

/// The corpus file: `# from X` names the source of the cases after it, other `#` lines are
/// comments, a JSON string is a case, `!gen NAME` a generated hostile case.
pub fn load(path: &Path) -> Result<Vec<Case>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut cases = Vec::new();
    let mut source = "corpus".to_owned();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end();
        if let Some(from) = line.strip_prefix("# from ") {
            source = from.to_owned();
        } else if line.is_empty() || line.starts_with('#') {
        } else if let Some(name) = line.strip_prefix("!gen ") {
            let text = generate(name)
                .ok_or_else(|| format!("{}:{}: no generator {name}", path.display(), n + 1))?;
            cases.push(Case {
                name: name.to_owned(),
                source: source.clone(),
                text,
                hostile: true,
            });
        } else {
            let text: String = serde_json::from_str(line)
                .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
            cases.push(Case {
                name: format!("#{}", cases.len() + 1),
                source: source.clone(),
                text,
                hostile: false,
            });
        }
    }
    Ok(cases)
}

const MB: usize = 1 << 20;

/// Hostile inputs too large for the corpus file.
pub fn generate(name: &str) -> Option<String> {
    let rep = |s: &str, n: usize| s.repeat(n);
    Some(match name {
        "word-1mb" => rep("a", MB),
        "quoted-word-1mb" => format!("echo '{}'", rep("a", MB)),
        "unclosed-quote-1mb" => format!("echo '{}", rep("a", MB)),
        "commands-1mb" => rep("git push; ", MB / 10),
        "pipeline-128k" => format!("{}a", rep("a|", 64 << 10)),
        "pipeline-256k" => format!("{}a", rep("a|", 128 << 10)),
        "dollars-128k" => rep("$", 128 << 10),
        "pipeline-1mb" => format!("{}a", rep("a|", MB / 2)),
        "and-or-1mb" => format!("{}b", rep("a && b || ", MB / 10)),
        "words-1mb" => format!("echo {}", rep("x ", MB / 2)),
        "newlines-1mb" => rep("\n", MB),
        "comment-1mb" => format!("# {}\ngit push", rep("x", MB)),
        "heredoc-1mb" => format!("cat <<EOF\n{}EOF\ngit push", rep("line $x\n", MB / 8)),
        "heredocs-10k-one-line" => {
            format!("cat{}\n{}git push", rep(" <<E", 10_000), rep("E\n", 10_000))
        }
        "subshell-depth-10k" => format!("{}git push{}", rep("(", 10_000), rep(")", 10_000)),
        "group-depth-10k" => format!("{}git push{}", rep("{ ", 10_000), rep("; }", 10_000)),
        "subst-depth-10k" => format!("{}git push{}", rep("$(", 10_000), rep(")", 10_000)),
        "quoted-subst-depth-1k" => {
            format!("{}git push{}", rep("echo \"$(", 1_000), rep(")\"", 1_000))
        }
        "if-depth-10k" => format!(
            "{}git push{}",
            rep("if true; then ", 10_000),
            rep("; fi", 10_000)
        ),
        "unclosed-subst-100k" => rep("$(", 100_000),
        "unclosed-paren-100k" => rep("(", 100_000),
        "unclosed-brace-expansion-100k" => rep("${", 100_000),
        "arith-depth-10k" => format!("echo $(({}1{}))", rep("(", 10_000), rep(")", 10_000)),
        "case-arms-100k" => format!("case x in {} esac", rep("a) git push;; ", 100_000)),
        "backslashes-1mb" => rep("\\", MB),
        "dollars-1mb" => rep("$", MB),
        _ => return None,
    })
}

/// How the two readings of one case compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Agreement {
    /// The same commands, the same certainty.
    Same,
    /// The same commands in another order (the policy checks every part: no difference to it).
    Order,
    /// The same commands; one reader is unsure.
    Certainty,
    /// Different commands, but both readers are unsure (the policy asks either way).
    BothUnsure,
    /// Different commands.
    Differ,
    /// One reader crashed, panicked or ran out of time.
    Failed,
}

pub struct Row {
    pub case_name: String,
    pub source: String,
    pub text: String,
    pub ours: Result<Shown, String>,
    pub ts: Result<Shown, String>,
    pub bash_n: String,
    pub agreement: Agreement,
}

pub struct Report {
    pub rows: Vec<Row>,
    pub corpus_ours: Timing,
    pub corpus_ts: Timing,
    pub corpus_cases: usize,
    /// Per generated case: (name, ours, ts).
    pub hostile_times: Vec<(String, Option<Timing>, Option<Timing>)>,
}

fn compare(a: &Result<Shown, String>, b: &Result<Shown, String>) -> Agreement {
    let (Ok(a), Ok(b)) = (a, b) else {
        return Agreement::Failed;
    };
    if a.commands == b.commands {
        if a.unsure == b.unsure {
            Agreement::Same
        } else {
            Agreement::Certainty
        }
    } else {
        let (mut x, mut y) = (a.commands.clone(), b.commands.clone());
        x.sort();
        y.sort();
        if x == y && a.unsure == b.unsure {
            Agreement::Order
        } else if x == y {
            Agreement::Certainty
        } else if a.unsure && b.unsure {
            Agreement::BothUnsure
        } else {
            Agreement::Differ
        }
    }
}

/// `bash -n`: does bash itself accept the syntax? (Reads, runs nothing.)
fn bash_n(src: &str) -> String {
    use std::io::Write;
    let child = Command::new("bash")
        .arg("-n")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        return "no bash".to_owned();
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(src.as_bytes());
    }
    match child.wait() {
        Ok(s) if s.success() => "ok".to_owned(),
        Ok(s) => match s.code() {
            Some(c) => format!("error {c}"),
            None => "crashed".to_owned(),
        },
        Err(_) => "?".to_owned(),
    }
}

/// In the child process: one reader on one generated case, its reading and timing as JSON.
pub fn probe_main(reader: &str, case: &str) -> Value {
    let Some(text) = generate(case) else {
        return json!({"error": format!("no case {case}")});
    };
    let mut parser = ts_bash::parser();
    let mut run = || match reader {
        "ours" => ours(&text),
        _ => tree_sitter(&mut parser, &text),
    };
    let shown = run();
    let t = timing::measure(5, 1, &mut || {
        std::hint::black_box(run());
    });
    json!({"shown": shown.to_json(), "median_ns": t.median_ns, "rounds": t.rounds})
}

pub fn run(corpus: &Path, quick: bool) -> Result<Report, String> {
    let cases = load(corpus)?;
    let mut parser = ts_bash::parser();
    let mut rows = Vec::new();
    let mut hostile_times = Vec::new();
    for case in &cases {
        let (o, t) = if case.hostile {
            let o = probe::run(&["shell", "ours", &case.name]);
            let t = probe::run(&["shell", "ts", &case.name]);
            let shown = |r: &Result<Value, String>| -> Result<Shown, String> {
                let v = r.as_ref().map_err(Clone::clone)?;
                Shown::from_json(&v["shown"]).ok_or_else(|| format!("bad probe answer {v}"))
            };
            let time = |r: &Result<Value, String>| -> Option<Timing> {
                let v = r.as_ref().ok()?;
                Some(Timing {
                    median_ns: v["median_ns"].as_f64()?,
                    rounds: v["rounds"].as_u64()? as usize,
                    per_round: 1,
                })
            };
            hostile_times.push((case.name.clone(), time(&o), time(&t)));
            (shown(&o), shown(&t))
        } else {
            let o = probe::catch(|| ours(&case.text));
            let t = probe::catch(|| tree_sitter(&mut parser, &case.text));
            (o, t)
        };
        let agreement = compare(&o, &t);
        rows.push(Row {
            case_name: case.name.clone(),
            source: case.source.clone(),
            text: case.text.clone(),
            bash_n: bash_n(&case.text),
            ours: o,
            ts: t,
            agreement,
        });
    }

    // Speed over the corpus proper (every case that is not generated): one pass reads them all.
    let plain: Vec<&str> = cases
        .iter()
        .filter(|c| !c.hostile)
        .map(|c| c.text.as_str())
        .collect();
    let rounds = if quick { 11 } else { 31 };
    let per_round = if quick { 10 } else { 50 };
    let corpus_ours = timing::measure(rounds, per_round, &mut || {
        for s in &plain {
            std::hint::black_box(ours(s));
        }
    });
    let corpus_ts = timing::measure(rounds, per_round, &mut || {
        for s in &plain {
            std::hint::black_box(tree_sitter(&mut parser, s));
        }
    });
    Ok(Report {
        rows,
        corpus_ours,
        corpus_ts,
        corpus_cases: plain.len(),
        hostile_times,
    })
}

pub fn print(r: &Report, out: &mut String) {
    let count = |a: Agreement| r.rows.iter().filter(|x| x.agreement == a).count();
    let _ = writeln!(out, "## Shell reader: ours against tree-sitter-bash\n");
    let _ = writeln!(
        out,
        "{} cases ({} from the corpus file, {} generated hostile): same {}, same but in \
         another order {}, same commands but one unsure {}, different commands but both unsure \
         {}, different commands {}, a reader failed {}.\n",
        r.rows.len(),
        r.corpus_cases,
        r.rows.len() - r.corpus_cases,
        count(Agreement::Same),
        count(Agreement::Order),
        count(Agreement::Certainty),
        count(Agreement::BothUnsure),
        count(Agreement::Differ),
        count(Agreement::Failed),
    );
    let unsure = |f: &dyn Fn(&Row) -> bool| r.rows.iter().filter(|x| f(x)).count();
    let _ = writeln!(
        out,
        "Unsure (the policy asks): ours {}, tree-sitter {}; a syntax error for `bash -n`: {}.\n",
        unsure(&|x| x.ours.as_ref().is_ok_and(|s| s.unsure)),
        unsure(&|x| x.ts.as_ref().is_ok_and(|s| s.unsure)),
        unsure(&|x| x.bash_n != "ok"),
    );
    let _ = writeln!(
        out,
        "Speed over the {} corpus strings (one pass reads them all; median of {} rounds of {}): \
         ours {}, tree-sitter-bash {} ({:.1}x).\n",
        r.corpus_cases,
        r.corpus_ours.rounds,
        r.corpus_ours.per_round,
        timing::show(r.corpus_ours.median_ns),
        timing::show(r.corpus_ts.median_ns),
        r.corpus_ts.median_ns / r.corpus_ours.median_ns,
    );
    let _ = writeln!(out, "| hostile case | size | ours | tree-sitter-bash |");
    let _ = writeln!(out, "|---|---:|---|---|");
    for (name, o, t) in &r.hostile_times {
        let row = r.rows.iter().find(|x| &x.case_name == name);
        let size = row.map_or(0, |x| x.text.len());
        let cell = |t: &Option<Timing>, s: Option<&Result<Shown, String>>| -> String {
            match (t, s) {
                (Some(t), Some(Ok(s))) => format!(
                    "{}, {} commands{}",
                    timing::show(t.median_ns),
                    s.commands.len(),
                    if s.unsure { ", unsure" } else { "" }
                ),
                (_, Some(Err(e))) => format!("**{e}**"),
                _ => "?".to_owned(),
            }
        };
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} |",
            timing::bytes(size),
            cell(o, row.map(|x| &x.ours)),
            cell(t, row.map(|x| &x.ts)),
        );
    }
    let _ = writeln!(out);
    for (title, a) in [
        ("Different commands", Agreement::Differ),
        ("A reader failed", Agreement::Failed),
        ("Same commands, one reader unsure", Agreement::Certainty),
        ("Different commands, both unsure", Agreement::BothUnsure),
        ("Same commands, another order", Agreement::Order),
    ] {
        let list: Vec<&Row> = r.rows.iter().filter(|x| x.agreement == a).collect();
        if list.is_empty() {
            continue;
        }
        let _ = writeln!(out, "### {title} ({})\n", list.len());
        for x in list {
            let input: String = format!("{:?}", x.text).chars().take(200).collect();
            let show = |s: &Result<Shown, String>| match s {
                Ok(s) => s.brief(),
                Err(e) => format!("FAILED: {e}"),
            };
            let _ = writeln!(
                out,
                "- {} ({}) `{input}` (bash -n: {})\n  - ours: {}\n  - tree-sitter: {}",
                x.case_name,
                x.source,
                x.bash_n,
                show(&x.ours),
                show(&x.ts)
            );
        }
        let _ = writeln!(out);
    }
}
