//! JUnit XML: the real reports of pytest, jest-junit and node's test runner (under
//! tests/runners/), and hostile documents: a billion laughs, a 1 MB test name, invalid UTF-8,
//! malformed and cut XML, deep nesting, a document that is not JUnit.

use std::path::PathBuf;
use std::time::Instant;

use taskbox_findings::junit::read_junit;
use taskbox_findings::{FindingKind, Findings, MAX_FINDINGS, MAX_NAME, Paths, TestCounts};

use FindingKind::{TestError, TestFailed};

fn data(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/runners")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

fn read(xml: &[u8]) -> Findings {
    read_junit(xml, &Paths::new("/workspace", "/workspace"))
}

type Row<'a> = (FindingKind, Option<&'a str>, &'a str, Option<u32>, &'a str);

fn rows(f: &Findings) -> Vec<Row<'_>> {
    f.findings
        .iter()
        .inspect(|x| assert_eq!(x.tool, "junit"))
        .map(|x| {
            let (file, line) = x
                .location
                .as_ref()
                .map_or(("", None), |l| (l.file.as_str(), l.line));
            (x.kind, x.name.as_deref(), file, line, x.message.as_str())
        })
        .collect()
}

fn counts(passed: u64, failed: u64, errored: u64, skipped: u64) -> Option<TestCounts> {
    Some(TestCounts {
        passed,
        failed,
        errored,
        skipped,
    })
}

#[test]
fn pytest_junitxml() {
    let f = read(&data("pytest_junit.xml"));
    let py = "tests/test_calc.py";
    assert_eq!(
        rows(&f),
        [
            (
                TestFailed,
                Some("tests.test_calc.test_add_wrong"),
                py,
                Some(17),
                "assert 3 == 4"
            ),
            (
                TestFailed,
                Some("tests.test_calc.test_helper"),
                py,
                Some(9),
                "AssertionError: helper saw a wrong value"
            ),
            (
                TestFailed,
                Some("tests.test_calc.TestGroup.test_in_class"),
                py,
                Some(41),
                "AssertionError: assert {'a': 1} == {'a': 2}"
            ),
            (
                TestError,
                Some("tests.test_calc.test_uses_broken"),
                py,
                Some(26),
                "failed on setup with \"RuntimeError: fixture exploded\""
            ),
        ]
    );
    assert_eq!(f.tests, counts(1, 3, 1, 1));
}

#[test]
fn jest_junit() {
    let f = read(&data("jest_junit.xml"));
    assert_eq!(
        rows(&f),
        [
            (
                TestFailed,
                Some("add adds wrong"),
                "src/calc.test.js",
                Some(9),
                "Error: expect(received).toBe(expected) // Object.is equality"
            ),
            (
                TestFailed,
                Some("parses"),
                "src/calc.js",
                Some(5),
                "Error: not a number: x"
            ),
            (
                TestFailed,
                Some("objects"),
                "src/calc.test.js",
                Some(20),
                "Error: expect(received).toEqual(expected) // deep equality"
            ),
        ]
    );
    assert_eq!(f.tests, counts(2, 3, 0, 1));
    // Frames in node_modules are left out of the excerpt.
    let ex = f.findings[0].excerpt.as_deref().unwrap_or("");
    assert!(ex.contains("Received: 3"), "{ex}");
    assert!(!ex.contains("node_modules"), "{ex}");
}

#[test]
fn node_test_reporter_junit() {
    let f = read(&data("node_junit.xml"));
    assert_eq!(
        rows(&f),
        [(
            TestFailed,
            Some("add > adds wrong"),
            "calc.test.mjs",
            Some(6),
            "Expected values to be strictly equal:3 !== 4"
        )]
    );
    assert_eq!(f.tests, counts(1, 1, 0, 1));
}

#[test]
fn surefire_shape_with_a_java_frame() {
    // Surefire's shape (classname, name, a stack trace with a Java frame naming a file only).
    let xml = br#"<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="com.x.CalcTest" tests="3" errors="1" skipped="0" failures="1">
  <testcase name="adds" classname="com.x.CalcTest" time="0.01"/>
  <testcase name="addsWrong" classname="com.x.CalcTest" time="0.01">
    <failure message="sum ==&gt; expected: &lt;4&gt; but was: &lt;3&gt;" type="org.opentest4j.AssertionFailedError"><![CDATA[org.opentest4j.AssertionFailedError: sum ==> expected: <4> but was: <3>
	at org.junit.jupiter.api.AssertionUtils.fail(AssertionUtils.java:151)
	at com.x.CalcTest.addsWrong(CalcTest.java:17)
]]></failure>
  </testcase>
  <testcase name="parses" classname="com.x.CalcTest" time="0.01">
    <error message="For input string: &quot;x&quot;" type="java.lang.NumberFormatException">java.lang.NumberFormatException: For input string: "x"
	at java.base/java.lang.Integer.parseInt(Integer.java:661)
</error>
  </testcase>
</testsuite>"#;
    let f = read(xml);
    assert_eq!(
        rows(&f),
        [
            (
                TestFailed,
                Some("com.x.CalcTest.addsWrong"),
                "CalcTest.java",
                Some(17),
                "sum ==> expected: <4> but was: <3>"
            ),
            (
                TestError,
                Some("com.x.CalcTest.parses"),
                "",
                None,
                "For input string: \"x\""
            ),
        ]
    );
    assert_eq!(f.tests, counts(1, 1, 1, 0));
}

#[test]
fn file_and_line_attributes_win() {
    let xml = br#"<testsuites><testsuite name="s"><testcase classname="a.B" name="c" file="src/a/b.py" line="12"><failure message="boom">tests/other.py:3: in c</failure></testcase></testsuite></testsuites>"#;
    assert_eq!(
        rows(&read(xml)),
        [(TestFailed, Some("a.B.c"), "src/a/b.py", Some(12), "boom")]
    );
}

/// DTD entities are not expanded: a billion laughs gives a bounded finding, fast.
#[test]
fn a_billion_laughs_stays_small() {
    let mut xml =
        String::from("<?xml version=\"1.0\"?>\n<!DOCTYPE lolz [\n<!ENTITY lol \"lol\">\n");
    for i in 1..10 {
        let prev = if i == 1 {
            "lol".to_string()
        } else {
            format!("lol{}", i - 1)
        };
        let refs: String = (0..10).map(|_| format!("&{prev};")).collect();
        xml.push_str(&format!("<!ENTITY lol{i} \"{refs}\">\n"));
    }
    xml.push_str("]>\n<testsuite><testcase classname=\"a\" name=\"&lol9;\"><failure message=\"&lol9;\">&lol9;&lol9;</failure></testcase></testsuite>\n");
    let start = Instant::now();
    let f = read(xml.as_bytes());
    assert!(start.elapsed().as_secs() < 2);
    assert_eq!(f.findings.len(), 1);
    let x = &f.findings[0];
    assert!(x.name.as_ref().is_some_and(|n| n.len() <= MAX_NAME));
    assert!(x.message.len() < 100, "{}", x.message);
    assert!(x.excerpt.as_ref().is_none_or(|e| e.len() < 100));
    assert_eq!(f.tests, counts(0, 1, 0, 0));
}

#[test]
fn a_1_mb_test_name_is_bounded() {
    let big = "n".repeat(1 << 20);
    let xml = format!(
        "<testsuite><testcase classname=\"{big}\" name=\"{big}x\"><failure message=\"{big}\">{big}</failure></testcase></testsuite>"
    );
    let f = read(xml.as_bytes());
    assert_eq!(f.findings.len(), 1);
    let x = &f.findings[0];
    assert!(x.name.as_ref().is_some_and(|n| n.len() <= MAX_NAME));
    assert!(x.message.len() <= taskbox_findings::MAX_MESSAGE);
}

#[test]
fn invalid_utf8_is_replaced() {
    let xml = b"<testsuite><testcase classname=\"a\xff\" name=\"b\"><failure message=\"bad \xfe\xff value\">x\xc3(</failure></testcase></testsuite>";
    let f = read(xml);
    assert_eq!(
        rows(&f),
        [(
            TestFailed,
            Some("a\u{fffd}.b"),
            "",
            None,
            "bad \u{fffd}\u{fffd} value"
        )]
    );
}

/// Malformed or cut XML: what was read before the error, no panic.
#[test]
fn malformed_xml_gives_what_came_before() {
    let whole = data("pytest_junit.xml");
    for cut in (0..whole.len()).step_by(97) {
        let f = read(&whole[..cut]);
        assert!(f.findings.len() <= 4);
    }
    let xml = b"<testsuite><testcase classname=\"a\" name=\"b\"><failure message=\"m\">t</failure></testcase><testcase name=\"c\"><failure></oops></testsuite><<<>>>";
    let f = read(xml);
    assert_eq!(f.findings.first().map(|x| x.message.as_str()), Some("m"));
    for junk in [
        &b""[..],
        b"not xml at all",
        b"<<<<",
        b"<a><b></a>",
        b"\x00\x01\x02",
        b"<testcase",
    ] {
        let _ = read(junk);
    }
}

#[test]
fn a_document_that_is_not_junit_gives_nothing() {
    let xml = br#"<?xml version="1.0"?><project><failure>not a test</failure><error/></project>"#;
    assert_eq!(read(xml), Findings::default());
}

/// Deep nesting and many failures: bounded memory and findings.
#[test]
fn deep_and_many_stay_bounded() {
    let mut xml = "<testsuite name=\"s\">".repeat(100_000);
    for i in 0..1000 {
        xml.push_str(&format!(
            "<testcase classname=\"c\" name=\"t{i}\"><failure message=\"m{i}\"/></testcase>"
        ));
    }
    xml.push_str(&"</testsuite>".repeat(100_000));
    let f = read(xml.as_bytes());
    assert_eq!(f.findings.len(), MAX_FINDINGS);
    assert_eq!(f.omitted, 900);
    assert_eq!(f.tests, counts(0, 1000, 0, 0));
}
