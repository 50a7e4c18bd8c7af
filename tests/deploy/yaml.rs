//! A strict reading of the manifests' YAML into JSON values, the form the Kubernetes API takes.
//!
//! Kubernetes reads YAML as YAML 1.1 (go-yaml, through sigs.k8s.io/yaml); the parser here is a
//! YAML 1.2 one. The two agree on everything but a few plain (unquoted) scalars: `yes`, `no`,
//! `on`, `off`, `y`, `n` are booleans to Kubernetes and strings here, `0755` is 493 to
//! Kubernetes and 755 here, `0x1F`, `1_000` and `2024-01-02` differ too. Such a scalar is
//! refused with the advice to quote it, so what this test checks is what Kubernetes reads.
//! Also refused, since the manifests have no use for them and each hides what a document says:
//! duplicate keys (the last would win silently), anchors and aliases, explicit tags, and keys
//! that are not strings.

use saphyr_parser::{Event, Parser, ScalarStyle, Span};
use serde_json::{Map, Number, Value};

/// The non-empty documents of `text`, each as a JSON value; an error names the line and column.
pub fn documents(text: &str) -> Result<Vec<Value>, String> {
    enum Frame {
        Seq(Vec<Value>),
        /// A mapping and the key whose value comes next.
        Map(Map<String, Value>, Option<String>),
    }
    let mut docs = Vec::new();
    let mut stack: Vec<Frame> = Vec::new();
    let mut root: Option<Value> = None;
    for item in Parser::new_from_str(text) {
        let (event, span) = item.map_err(|e| format!("not YAML: {e}"))?;
        let value = match event {
            Event::Nothing | Event::StreamStart | Event::StreamEnd => continue,
            Event::DocumentStart(_) => {
                root = None;
                continue;
            }
            Event::DocumentEnd => {
                // A document of comments alone is null; kubectl skips those too.
                match root.take() {
                    Some(Value::Null) | None => {}
                    Some(v) => docs.push(v),
                }
                continue;
            }
            Event::Alias(_) => return Err(at(span, "an alias: write the value out")),
            Event::Scalar(text, style, anchor, tag) => {
                plain_node(anchor, tag.is_some(), span)?;
                scalar(&text, style, span)?
            }
            Event::SequenceStart(anchor, tag) => {
                plain_node(anchor, tag.is_some(), span)?;
                stack.push(Frame::Seq(Vec::new()));
                continue;
            }
            Event::MappingStart(anchor, tag) => {
                plain_node(anchor, tag.is_some(), span)?;
                stack.push(Frame::Map(Map::new(), None));
                continue;
            }
            Event::SequenceEnd => match stack.pop() {
                Some(Frame::Seq(items)) => Value::Array(items),
                _ => return Err(at(span, "a sequence ends that did not start")),
            },
            Event::MappingEnd => match stack.pop() {
                Some(Frame::Map(map, None)) => Value::Object(map),
                _ => return Err(at(span, "a mapping ends before its last value")),
            },
        };
        match stack.last_mut() {
            None => root = Some(value),
            Some(Frame::Seq(items)) => items.push(value),
            Some(Frame::Map(map, next)) => match next.take() {
                Some(key) => {
                    map.insert(key, value);
                }
                None => {
                    let Value::String(key) = value else {
                        return Err(at(span, "a key that is not a string"));
                    };
                    if key == "<<" {
                        return Err(at(span, "a merge key (<<): write the keys out"));
                    }
                    if map.contains_key(&key) {
                        return Err(at(span, format!("the key {key:?} again in one mapping")));
                    }
                    *next = Some(key);
                }
            },
        }
    }
    Ok(docs)
}

fn at(span: Span, what: impl std::fmt::Display) -> String {
    format!(
        "line {}, column {}: {what}",
        span.start.line(),
        span.start.col() + 1
    )
}

fn plain_node(anchor: usize, tagged: bool, span: Span) -> Result<(), String> {
    if anchor != 0 {
        return Err(at(
            span,
            "an anchor (&name): write the value out where it is used",
        ));
    }
    if tagged {
        return Err(at(span, "an explicit tag (!!type): quote a string instead"));
    }
    Ok(())
}

/// Plain scalars that YAML 1.1 reads as booleans and YAML 1.2 as strings (`true` and `false`
/// are booleans in both).
const YAML11_BOOLEANS: &[&str] = &[
    "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off",
    "OFF",
];

fn scalar(text: &str, style: ScalarStyle, span: Span) -> Result<Value, String> {
    if style != ScalarStyle::Plain {
        return Ok(Value::String(text.to_owned()));
    }
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Ok(Value::Null),
        "true" | "True" | "TRUE" => return Ok(Value::Bool(true)),
        "false" | "False" | "FALSE" => return Ok(Value::Bool(false)),
        _ => {}
    }
    if YAML11_BOOLEANS.contains(&text) {
        return Err(at(
            span,
            format!(
                "{text} is a boolean to Kubernetes (YAML 1.1) and a string to YAML 1.2: quote it"
            ),
        ));
    }
    if is_decimal_int(text) {
        return text
            .parse::<i64>()
            .map(|n| Value::Number(n.into()))
            .map_err(|_| at(span, format!("{text} does not fit in 64 bits: quote it")));
    }
    if is_float(text) {
        return text
            .parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| at(span, format!("{text} is not a finite number")));
    }
    if reads_differently(text) {
        return Err(at(
            span,
            format!(
                "{text} looks like a number or a date, which YAML 1.1 (Kubernetes) and YAML 1.2 \
                 may read differently: quote it (or write a number in plain decimal)"
            ),
        ));
    }
    Ok(Value::String(text.to_owned()))
}

/// `0`, or digits without a leading zero, with an optional `-`: an integer to both versions.
fn is_decimal_int(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
}

/// A float to both versions: decimal digits with a point and/or an exponent, no leading zero
/// before further digits (`-1.5`, `0.25`, `1e3`, `2.5E-3`).
fn is_float(s: &str) -> bool {
    let s = s.strip_prefix('-').unwrap_or(s);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (mantissa, None),
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let int_ok = digits(int) && (int == "0" || !int.starts_with('0'));
    let frac_ok = frac.is_none_or(digits);
    let exp_ok = exponent.is_none_or(|e| digits(e.strip_prefix(['-', '+']).unwrap_or(e)));
    int_ok && frac_ok && exp_ok && (frac.is_some() || exponent.is_some())
}

/// What YAML 1.1 (go-yaml) takes for a number or a timestamp and YAML 1.2 for something else,
/// or the other way round: a leading `+` or zero, `0x`/`0o`/`0b` prefixes, `_` between digits,
/// `.inf` and `.nan`, dates.
fn reads_differently(s: &str) -> bool {
    let unsigned = s.strip_prefix(['-', '+']).unwrap_or(s);
    let lower = unsigned.to_ascii_lowercase();
    if s.starts_with('+') && unsigned.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return true;
    }
    if lower == ".inf" || lower == ".nan" {
        return true;
    }
    let numberish = |t: &str| {
        !t.is_empty()
            && t.bytes()
                .all(|b| b.is_ascii_hexdigit() || matches!(b, b'_' | b'.' | b'x' | b'o' | b'e'))
    };
    if unsigned.starts_with(|c: char| c.is_ascii_digit()) && numberish(&lower) {
        // What is left after the two exact forms above: 0755, 0x1f, 0o17, 0b101, 1_000, 08.5.
        return true;
    }
    // YYYY-M-D, alone or followed by a time.
    let mut parts = s.splitn(3, '-');
    let (y, m, rest) = (parts.next(), parts.next(), parts.next());
    if let (Some(y), Some(m), Some(rest)) = (y, m, rest) {
        let day: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let num = |t: &str, n: std::ops::RangeInclusive<usize>| {
            n.contains(&t.len()) && t.bytes().all(|b| b.is_ascii_digit())
        };
        if num(y, 4..=4) && num(m, 1..=2) && num(&day, 1..=2) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::documents;
    use serde_json::json;

    #[test]
    fn documents_are_read_as_kubernetes_reads_them() {
        let docs = documents(
            "# a comment alone\n---\na: 1\nb: \"yes\"\nc: [x, 2.5, true, null]\nd: |\n  text\n---\n",
        )
        .unwrap();
        assert_eq!(
            docs,
            vec![json!({"a": 1, "b": "yes", "c": ["x", 2.5, true, null], "d": "text\n"})]
        );
        // Strings that only look close to numbers stay strings.
        let docs =
            documents("a: 0.0.0.0:9464\nb: 250m\nc: 2.12.8-alpine\nd: 1Gi\ne: 30s\n").unwrap();
        assert_eq!(
            docs,
            vec![
                json!({"a": "0.0.0.0:9464", "b": "250m", "c": "2.12.8-alpine", "d": "1Gi", "e": "30s"})
            ]
        );
    }

    #[test]
    fn what_yaml_1_1_reads_otherwise_must_be_quoted() {
        for bad in [
            "a: yes",
            "a: off",
            "a: N",
            "a: 0755",
            "a: 0x1F",
            "a: 1_000",
            "a: +1",
            "a: .inf",
            "a: 2024-01-02",
            "on: 1",
        ] {
            let err = documents(bad).unwrap_err();
            assert!(err.contains("quote it"), "{bad}: {err}");
        }
        for good in [
            "a: \"yes\"",
            "a: '0755'",
            "a: 493",
            "a: -3",
            "a: 0",
            "a: 1e3",
        ] {
            documents(good).unwrap();
        }
    }

    #[test]
    fn hidden_meanings_are_refused() {
        for (bad, why) in [
            ("a: 1\na: 2\n", "again in one mapping"),
            ("a: &x 1\nb: *x\n", "anchor"),
            ("a: !!str 1\n", "tag"),
            ("<<: {a: 1}\n", "merge key"),
            ("? [a]\n: 1\n", "not a string"),
            ("a: [1\n", "not YAML"),
        ] {
            let err = documents(bad).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }
}
