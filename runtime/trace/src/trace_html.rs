//! A trace as one self-contained HTML page: the summary at the top, then the timeline (one bar
//! per operation, placed by its start and sized by its duration, coloured by its outcome), then
//! one expandable item per operation with its request, output, violations and diffs (added and
//! removed lines in colour). No network: the CSS and the few lines of script are inline, and
//! every recorded string is HTML-escaped.
//!
//! The script only adds conveniences: clicking a bar opens its item, and `?open=SEQ` (or
//! `?open=all`) opens items on load and writes what is shown into `data-check` on the root
//! element, which the browser-driven test reads.

use std::fmt::Write as _;

use serde_json::Value;

use crate::trace::{Outcome, Trace, TraceOp, WorkspaceBase, op_detail};

const CSS: &str = r#"
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d1f23;background:#f6f7f9}
header,main{max-width:1100px;margin:0 auto;padding:12px 20px}
h1{font-size:20px;margin:8px 0}
.summary{display:flex;flex-wrap:wrap;gap:8px;margin:8px 0}
.pill{background:#fff;border:1px solid #d5d8de;border-radius:12px;padding:2px 10px}
.pill.bad{border-color:#d33;color:#b00}
table.meta td{padding:1px 10px 1px 0;vertical-align:top}
.timeline{position:relative;background:#fff;border:1px solid #d5d8de;border-radius:6px;margin:12px 0}
.row{position:relative;height:18px;border-bottom:1px solid #f0f1f3}
.bar{position:absolute;top:3px;height:12px;min-width:3px;border-radius:3px;background:#3b82f6;cursor:pointer}
.bar.ok{background:#22a55a}.bar.fail{background:#e04040}.bar.viol{background:#e8a317}.bar.bg{background:#8b5cf6}
.lab{position:absolute;left:4px;top:1px;font-size:11px;color:#555;pointer-events:none;white-space:nowrap}
details.op{background:#fff;border:1px solid #d5d8de;border-radius:6px;margin:6px 0}
details.op>summary{padding:6px 10px;cursor:pointer;font-family:ui-monospace,monospace}
details.op[open]>summary{border-bottom:1px solid #e3e5e9}
.body{padding:6px 12px}
.st-ok{color:#1a7f45}.st-fail{color:#c22}.st-viol{color:#a36a00}
pre{background:#f3f4f6;padding:8px;overflow:auto;max-height:420px;margin:4px 0;white-space:pre-wrap}
pre.diff .add{color:#116329;background:#e6ffec}pre.diff .del{color:#82071e;background:#ffebe9}
pre.diff .hunk{color:#6f42c1}
.note{color:#a36a00}
"#;

const SCRIPT: &str = r#"
document.querySelectorAll('.bar').forEach(function(b){
  b.addEventListener('click',function(){
    var d=document.getElementById('op-'+b.dataset.seq); if(d){d.open=true;d.scrollIntoView();}
  });
});
(function(){
  var want=new URLSearchParams(location.search).get('open'); if(!want)return;
  var items=document.querySelectorAll('details.op');
  items.forEach(function(d){
    if(want==='all'||d.id==='op-'+want){d.querySelector('summary').click();}
  });
  var shown=[];
  items.forEach(function(d){
    if(!d.open)return;
    var pre=d.querySelector('pre.out');
    shown.push({seq:d.id.slice(3),height:pre?pre.getBoundingClientRect().height:0,
      text:pre?pre.innerText.slice(0,200):''});
  });
  document.documentElement.dataset.check=JSON.stringify({
    bars:document.querySelectorAll('.timeline .bar').length,items:items.length,open:shown});
})();
"#;

/// The page for `trace`.
pub fn render_html(trace: &Trace) -> String {
    let h = &trace.header;
    let mut out = String::with_capacity(16 * 1024);
    out.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    out.push_str("<meta name=\"viewport\" content=\"width=device-width\">");
    out.push_str(
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; \
         style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">",
    );
    let _ = write!(
        out,
        "<title>taskbox trace {}</title><style>{CSS}</style></head><body>",
        esc(&h.sandbox)
    );

    // Summary.
    let (mut execs, mut nonzero, mut failed, mut violations) = (0, 0, 0, 0);
    for op in &trace.ops {
        let s = status(op);
        if op.name() == Some(crate::api::OpName::Exec) {
            execs += 1;
            if s.class != "ok" && s.class != "bg" {
                nonzero += 1;
            }
        }
        if matches!(op.outcome, Outcome::Error(_)) {
            failed += 1;
        }
        violations += s.violations;
    }
    let start = trace
        .ops
        .first()
        .map_or(h.created_at_ms, |o| o.started_at_ms.min(h.created_at_ms));
    let end = trace
        .ops
        .iter()
        .map(|o| o.started_at_ms + o.duration_ms)
        .max()
        .unwrap_or(start)
        .max(start + 1);
    let span = end - start;
    out.push_str("<header>");
    let _ = write!(out, "<h1>Trace of sandbox {}</h1>", esc(&h.sandbox));
    out.push_str("<div class=\"summary\" id=\"summary\">");
    let pill = |out: &mut String, bad: bool, text: String| {
        let _ = write!(
            out,
            "<span class=\"pill{}\">{}</span>",
            if bad { " bad" } else { "" },
            esc(&text)
        );
    };
    pill(&mut out, false, format!("{} operations", trace.ops.len()));
    pill(
        &mut out,
        nonzero > 0,
        format!("{execs} execs, {nonzero} not exit 0"),
    );
    pill(&mut out, failed > 0, format!("{failed} failed"));
    pill(&mut out, violations > 0, format!("{violations} violations"));
    pill(&mut out, false, format!("{:.1}s", span as f64 / 1000.0));
    out.push_str("</div><table class=\"meta\">");
    let created = crate::trace::timestamp_ms(h.created_at_ms);
    let base = match &h.workspace_base {
        WorkspaceBase::Git { commit, dirty } => {
            format!("git {commit}{}", if *dirty { " (dirty)" } else { "" })
        }
        WorkspaceBase::Tar { sha256 } => format!("tar sha256 {sha256}"),
        WorkspaceBase::Dir {
            sha256, entries, ..
        } => format!("directory sha256 {sha256} ({entries} entries)"),
        WorkspaceBase::None => "not a git checkout".into(),
    };
    for (k, v) in [
        ("created", created.to_string()),
        ("backend", h.backend.clone()),
        ("image", h.image.clone()),
        ("policy", format!("{} (sha256 {})", h.policy, h.policy_hash)),
        ("workspace", format!("{}  base {base}", h.workspace)),
        ("taskbox", format!("{} (trace v{})", h.taskbox, h.version)),
    ] {
        let _ = write!(out, "<tr><td>{k}</td><td>{}</td></tr>", esc(&v));
    }
    out.push_str("</table>");
    if let Some(tail) = &trace.torn_tail {
        let _ = write!(
            out,
            "<p class=\"note\">The trace ends in an incomplete line ({} bytes): a write cut short \
             by a crash, never acknowledged.</p>",
            tail.len()
        );
    }
    out.push_str("</header><main>");

    // Timeline.
    out.push_str("<div class=\"timeline\" id=\"timeline\">");
    for op in &trace.ops {
        let s = status(op);
        let left = (op.started_at_ms.saturating_sub(start)) as f64 * 100.0 / span as f64;
        let width = (op.duration_ms as f64 * 100.0 / span as f64).max(0.3);
        let _ = write!(
            out,
            "<div class=\"row\"><div class=\"bar {}\" data-seq=\"{}\" style=\"left:{left:.3}%;width:{:.3}%\" \
             title=\"#{} {} — {} — {} ms\"></div><span class=\"lab\">#{} {}</span></div>",
            s.class,
            op.seq,
            width.min(100.0 - left).max(0.3),
            op.seq,
            esc(&op.op),
            esc(&s.text),
            op.duration_ms,
            op.seq,
            esc(&op.op),
        );
    }
    out.push_str("</div>");

    // Items.
    for op in &trace.ops {
        let s = status(op);
        let _ = write!(
            out,
            "<details class=\"op\" id=\"op-{}\"><summary>#{} <b>{}</b> <span class=\"st-{}\">{}</span> \
             {} ms {}</summary><div class=\"body\">",
            op.seq,
            op.seq,
            esc(&op.op),
            if s.class == "bg" { "ok" } else { s.class },
            esc(&s.text),
            op.duration_ms,
            esc(&op_detail(op)),
        );
        item_body(&mut out, op);
        out.push_str("</div></details>");
    }
    let _ = writeln!(out, "</main><script>{SCRIPT}</script></body></html>");
    out
}

struct Status {
    class: &'static str,
    text: String,
    violations: usize,
}

fn status(op: &TraceOp) -> Status {
    match &op.outcome {
        Outcome::Error(e) => Status {
            class: "fail",
            text: format!("failed: {}", e.code),
            violations: 0,
        },
        Outcome::Ok(v) => {
            // A finished exec, else a background process's result once it ended, else the
            // process itself (still running).
            let r = if v.get("exit_code").is_some() {
                Some(v)
            } else {
                v.get("result")
                    .filter(|r| !r.is_null())
                    .or_else(|| v.get("exec_id").map(|_| v))
            };
            let viols = r
                .and_then(|r| r.get("violations"))
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            let Some(r) = r else {
                return Status {
                    class: "ok",
                    text: "ok".into(),
                    violations: 0,
                };
            };
            if r.get("exit_code").is_none()
                && let Some(id) = r.get("exec_id").and_then(Value::as_u64)
            {
                return Status {
                    class: "bg",
                    text: format!("background #{id}"),
                    violations: viols,
                };
            }
            let (class, text) = if r.get("timed_out").and_then(Value::as_bool) == Some(true) {
                ("fail", "timed out".to_string())
            } else if let Some(sig) = r.get("signal").and_then(Value::as_i64) {
                ("fail", format!("signal {sig}"))
            } else {
                match r.get("exit_code").and_then(Value::as_i64) {
                    Some(0) => ("ok", "exit 0".to_string()),
                    Some(c) => ("fail", format!("exit {c}")),
                    None => ("fail", "no exit code".to_string()),
                }
            };
            let class = if viols > 0 { "viol" } else { class };
            let text = if viols > 0 {
                format!(
                    "{text}, {viols} violation{}",
                    if viols == 1 { "" } else { "s" }
                )
            } else {
                text
            };
            Status {
                class,
                text,
                violations: viols,
            }
        }
    }
}

fn item_body(out: &mut String, op: &TraceOp) {
    let _ = write!(
        out,
        "<div>request</div><pre class=\"req\">{}</pre>",
        esc(&serde_json::to_string_pretty(&without_nulls(&op.request)).unwrap_or_default())
    );
    let v = match &op.outcome {
        Outcome::Error(e) => {
            let _ = write!(
                out,
                "<div class=\"st-fail\">error {}</div><pre class=\"out\">{}</pre>",
                esc(&e.code),
                esc(&e.message)
            );
            return;
        }
        Outcome::Ok(v) => v,
    };
    let r = if v.get("stdout").is_some() {
        v
    } else {
        v.get("result").filter(|r| !r.is_null()).unwrap_or(v)
    };
    let mut shown = false;
    for stream in ["stdout", "stderr"] {
        if let Some(t) = r
            .get(stream)
            .and_then(|s| s.get("text"))
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty() || stream == "stdout")
        {
            let _ = write!(
                out,
                "<div>{stream}</div><pre class=\"out {stream}\">{}</pre>",
                esc(t)
            );
            shown = true;
        }
    }
    if let Some(vs) = r.get("violations").and_then(Value::as_array)
        && !vs.is_empty()
    {
        out.push_str("<div class=\"st-viol\">violations</div><ul>");
        for viol in vs {
            let _ = write!(
                out,
                "<li>{}: {}</li>",
                esc(viol.get("kind").and_then(Value::as_str).unwrap_or("?")),
                esc(viol.get("detail").and_then(Value::as_str).unwrap_or(""))
            );
        }
        out.push_str("</ul>");
    }
    if let Some(cs) = r.get("changes").and_then(Value::as_array)
        && !cs.is_empty()
    {
        out.push_str("<div>changes</div><ul>");
        for c in cs {
            let _ = write!(
                out,
                "<li>{} {}</li>",
                esc(c.get("kind").and_then(Value::as_str).unwrap_or("")),
                esc(c.get("path").and_then(Value::as_str).unwrap_or(""))
            );
        }
        out.push_str("</ul>");
    }
    for key in ["diff", "patch"] {
        let text = v
            .get(key)
            .and_then(Value::as_str)
            .or_else(|| op.request.get(key).and_then(Value::as_str));
        if let Some(d) = text.filter(|d| !d.is_empty()) {
            let _ = write!(out, "<div>{key}</div>");
            diff_pre(out, d);
            shown = true;
        }
    }
    if let Some(c) = v.get("content").and_then(Value::as_str) {
        let _ = write!(out, "<div>content</div><pre class=\"out\">{}</pre>", esc(c));
        shown = true;
    }
    if !shown {
        let _ = write!(
            out,
            "<div>observation</div><pre class=\"out\">{}</pre>",
            esc(&serde_json::to_string_pretty(v).unwrap_or_default())
        );
    }
}

/// A request without its unset (null) fields, for reading.
fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(o) => Value::Object(
            o.iter()
                .filter(|(_, x)| !x.is_null())
                .map(|(k, x)| (k.clone(), without_nulls(x)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn diff_pre(out: &mut String, d: &str) {
    out.push_str("<pre class=\"diff out\">");
    for line in d.lines() {
        let class = if line.starts_with("+++") || line.starts_with("---") {
            ""
        } else if line.starts_with('+') {
            "add"
        } else if line.starts_with('-') {
            "del"
        } else if line.starts_with("@@") {
            "hunk"
        } else {
            ""
        };
        if class.is_empty() {
            let _ = writeln!(out, "{}", esc(line));
        } else {
            let _ = writeln!(out, "<span class=\"{class}\">{}</span>", esc(line));
        }
    }
    out.push_str("</pre>");
}

/// HTML-escapes text for element content and double-quoted attributes.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            _ => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{ErrorBody, TraceHeader};
    use serde_json::json;
    use std::collections::BTreeMap;

    fn trace() -> Trace {
        let op = |seq, name: &str, request, outcome| TraceOp {
            seq,
            op: name.into(),
            started_at_ms: 1_000 + seq * 100,
            duration_ms: 50,
            request,
            outcome,
            start: None,
        };
        Trace {
            header: TraceHeader {
                version: 1,
                taskbox: "0.1.0".into(),
                sandbox: "sb-1".into(),
                created_at_ms: 1_000,
                backend: "native".into(),
                image: "host".into(),
                policy: "default".into(),
                policy_hash: "ab".into(),
                policy_toml: None,
                workspace: "/w".into(),
                workspace_base: WorkspaceBase::None,
                env: BTreeMap::new(),
                labels: BTreeMap::new(),
                adopted: false,
                fork: None,
            },
            ops: vec![
                op(1, "create", json!({}), Outcome::Ok(json!({}))),
                op(
                    2,
                    "exec",
                    json!({"shell": "echo '<b>'"}),
                    Outcome::Ok(
                        json!({"exit_code": 1, "stdout": {"text": "<script>x</script>"},
                        "violations": [{"kind": "network", "detail": "denied"}]}),
                    ),
                ),
                op(
                    3,
                    "edit",
                    json!({"path": "a"}),
                    Outcome::Ok(json!({"diff": "--- a\n+++ b\n@@ -1 +1 @@\n-old\n+new\n"})),
                ),
                op(
                    4,
                    "patch",
                    json!({}),
                    Outcome::Error(ErrorBody {
                        code: "patch_failed".into(),
                        message: "no".into(),
                    }),
                ),
            ],
            unfinished: Vec::new(),
            torn_tail: None,
        }
    }

    #[test]
    fn one_bar_and_one_item_per_op_everything_escaped() {
        let page = render_html(&trace());
        assert_eq!(page.matches("class=\"bar ").count(), 4);
        assert_eq!(page.matches("<details class=\"op\"").count(), 4);
        assert!(!page.contains("<script>x</script>"), "output is escaped");
        assert!(page.contains("&lt;script&gt;x&lt;/script&gt;"));
        assert!(page.contains("<span class=\"add\">+new</span>"));
        assert!(page.contains("<span class=\"del\">-old</span>"));
        assert!(
            page.contains("class=\"bar viol\""),
            "violations colour the bar"
        );
        assert!(page.contains("1 violations"));
        assert!(
            !page.contains("http://") && !page.contains("https://"),
            "no network"
        );
    }
}
