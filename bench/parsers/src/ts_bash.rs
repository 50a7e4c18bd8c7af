//! The same reading as `taskbox_policy::shell::parse`, built on tree-sitter-bash: the simple
//! commands of a script with their words (quotes removed, words known only at run time marked),
//! and what the reading cannot be sure of.
//!
//! The tree gives the grammar; quote removal, which expansions split or glob, and what a
//! command is (a declaration, a `[ .. ]` test) are still decided here, word by word, as ours
//! decides them, so that the two can be compared case by case.

use taskbox_policy::shell::Word;
use tree_sitter::{Node, Parser};

/// What a reading found.
#[derive(Debug, Default)]
pub struct Reading {
    pub commands: Vec<Vec<Word>>,
    pub unsure: Vec<String>,
}

pub fn parser() -> Parser {
    let mut p = Parser::new();
    // The grammar is compiled in: its ABI matches the runtime's (checked at start-up).
    if let Err(e) = p.set_language(&tree_sitter_bash::LANGUAGE.into()) {
        panic!("tree-sitter-bash does not load: {e}");
    }
    p
}

pub fn read(parser: &mut Parser, src: &str) -> Reading {
    let mut out = Reading::default();
    let Some(tree) = parser.parse(src, None) else {
        out.unsure.push("tree-sitter gave no tree".to_owned());
        return out;
    };
    let root = tree.root_node();
    if root.has_error() {
        out.unsure
            .push("syntax error (an ERROR or MISSING node)".to_owned());
    }
    let b = src.as_bytes();
    // Post-order walk with an explicit stack (deep scripts must not need a deep Rust stack):
    // a command is emitted after the substitutions inside it, as ours orders them.
    let mut stack: Vec<(Node, bool)> = vec![(root, false)];
    while let Some((node, exiting)) = stack.pop() {
        if exiting {
            if let Some(words) = command_words(node, b, &mut out.unsure)
                && !words.is_empty()
            {
                out.commands.push(words);
            }
            continue;
        }
        match node.kind() {
            "command" | "declaration_command" | "unset_command" | "test_command" => {
                stack.push((node, true));
            }
            "c_style_for_statement" | "arithmetic_expansion" => {
                // Arithmetic runs no command, but `$(..)` inside it does: the walk goes on.
            }
            _ => {}
        }
        let mut cursor = node.walk();
        let children: Vec<Node> = node.children(&mut cursor).collect();
        for child in children.into_iter().rev() {
            stack.push((child, false));
        }
    }
    out
}

/// The words of a command-like node; `None` when it is no command (`[[ .. ]]`).
fn command_words(node: Node, b: &[u8], unsure: &mut Vec<String>) -> Option<Vec<Word>> {
    let mut words = Vec::new();
    match node.kind() {
        "command" => {
            if let Some(name) = node.child_by_field_name("name") {
                let inner = name.named_child(0).unwrap_or(name);
                words.push(word(inner, b, unsure));
            }
            let mut cursor = node.walk();
            let mut translated = false;
            for arg in node.children_by_field_name("argument", &mut cursor) {
                // bash's `$"..."` comes as a `$` and a string: one word, its text unknown
                // (a translation), as ours reads it.
                if !arg.is_named() && text(arg, b) == "$" {
                    translated = true;
                    continue;
                }
                if std::mem::take(&mut translated) {
                    words.push(Word::One { base: None });
                    continue;
                }
                words.push(word(arg, b, unsure));
            }
        }
        "declaration_command" | "unset_command" => {
            let mut cursor = node.walk();
            for (i, child) in node.children(&mut cursor).enumerate() {
                if i == 0 && !child.is_named() {
                    words.push(Word::Lit(text(child, b).to_owned()));
                } else if child.is_named() {
                    match child.kind() {
                        "variable_name" => words.push(Word::Lit(text(child, b).to_owned())),
                        "variable_assignment" => words.push(word(child, b, unsure)),
                        k if k.ends_with("redirect") => {}
                        _ => words.push(word(child, b, unsure)),
                    }
                }
            }
        }
        "test_command" => {
            let first = node.child(0).map(|c| text(c, b)).unwrap_or_default();
            if first != "[" {
                return None;
            }
            flatten(node, b, unsure, &mut words);
        }
        _ => return None,
    }
    Some(words)
}

/// A `[ .. ]` test as words: every leaf or word-like node in order.
fn flatten(node: Node, b: &[u8], unsure: &mut Vec<String>, out: &mut Vec<Word>) {
    let mut cursor = node.walk();
    for child in node.children(&mut cursor) {
        match child.kind() {
            "unary_expression" | "binary_expression" | "parenthesized_expression" => {
                flatten(child, b, unsure, out)
            }
            _ if !child.is_named() || child.kind() == "test_operator" => {
                out.push(Word::Lit(text(child, b).to_owned()))
            }
            _ => out.push(word(child, b, unsure)),
        }
    }
}

fn text<'a>(node: Node, b: &'a [u8]) -> &'a str {
    std::str::from_utf8(&b[node.byte_range()]).unwrap_or("")
}

/// Builds one word as ours does: literal text, or one word of unknown text, or any number.
#[derive(Default)]
struct Builder {
    text: String,
    one: bool,
    many: bool,
    last_expansion: Option<usize>,
    bracket_open: bool,
    brace_open: bool,
    brace_sep: bool,
    at_start: bool,
}

impl Builder {
    fn expansion(&mut self, quoted: bool) {
        if quoted {
            self.one = true;
        } else {
            self.many = true;
        }
        self.last_expansion = Some(self.text.len());
    }

    /// Unquoted literal text: backslashes removed, patterns and a leading `~` noticed.
    fn unquoted(&mut self, s: &str) {
        let mut chars = s.chars().peekable();
        if self.at_start && s.starts_with('~') {
            chars.next();
            while chars
                .peek()
                .is_some_and(|c| c.is_ascii_alphanumeric() || "._-+".contains(*c))
            {
                chars.next();
            }
            self.expansion(true);
        }
        self.at_start = false;
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('\n') => {}
                    Some(n) => self.text.push(n),
                    None => self.text.push('\\'),
                },
                '*' | '?' => {
                    self.many = true;
                    self.text.push(c);
                }
                '[' => {
                    self.bracket_open = true;
                    self.text.push(c);
                }
                ']' if self.bracket_open => {
                    self.many = true;
                    self.text.push(c);
                }
                '{' => {
                    self.brace_open = true;
                    self.text.push(c);
                }
                ',' if self.brace_open => {
                    self.brace_sep = true;
                    self.text.push(c);
                }
                '.' if self.brace_open && chars.peek() == Some(&'.') => {
                    self.brace_sep = true;
                    self.text.push(c);
                }
                '}' if self.brace_open && self.brace_sep => {
                    self.many = true;
                    self.text.push(c);
                }
                _ => self.text.push(c),
            }
        }
    }

    /// Literal text inside double quotes: only `\$ \` \" \\` and `\newline` are escapes.
    fn double_quoted(&mut self, s: &str) {
        self.at_start = false;
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.peek() {
                    Some('\n') => {
                        chars.next();
                    }
                    Some(&n @ ('$' | '`' | '"' | '\\')) => {
                        chars.next();
                        self.text.push(n);
                    }
                    _ => self.text.push('\\'),
                }
            } else {
                self.text.push(c);
            }
        }
    }

    fn finish(self) -> Word {
        if self.many {
            Word::Many
        } else if self.one {
            let after = self.last_expansion.unwrap_or(0);
            let base = self
                .text
                .rfind('/')
                .filter(|slash| *slash >= after)
                .map(|slash| self.text[slash + 1..].to_owned())
                .filter(|b| !b.is_empty());
            Word::One { base }
        } else {
            Word::Lit(self.text)
        }
    }
}

fn word(node: Node, b: &[u8], unsure: &mut Vec<String>) -> Word {
    let mut w = Builder {
        at_start: true,
        ..Builder::default()
    };
    piece(node, b, false, &mut w, unsure);
    w.finish()
}

fn piece(node: Node, b: &[u8], quoted: bool, w: &mut Builder, unsure: &mut Vec<String>) {
    match node.kind() {
        "word" | "number" | "variable_name" | "file_descriptor" => {
            if quoted {
                w.double_quoted(text(node, b));
            } else {
                w.unquoted(text(node, b));
            }
        }
        "raw_string" => {
            let t = text(node, b);
            w.at_start = false;
            w.text.push_str(
                t.strip_prefix('\'')
                    .and_then(|t| t.strip_suffix('\''))
                    .unwrap_or(t),
            );
        }
        "string" => {
            // The text between the quotes; the gaps between the named children are literal.
            let (start, end) = (node.start_byte() + 1, node.end_byte().saturating_sub(1));
            w.at_start = false;
            gaps(node, b, start, end, true, w, unsure);
        }
        "concatenation" | "variable_assignment" => gaps(
            node,
            b,
            node.start_byte(),
            node.end_byte(),
            quoted,
            w,
            unsure,
        ),
        "string_content" | "heredoc_content" => w.double_quoted(text(node, b)),
        "ansi_c_string" | "translated_string" | "process_substitution" => {
            w.at_start = false;
            w.expansion(true);
        }
        "simple_expansion" | "expansion" => {
            w.at_start = false;
            let t = text(node, b);
            let inner = t.trim_start_matches('$').trim_start_matches('{');
            if inner.starts_with('@') || inner.starts_with('*') || t.contains("[@]") {
                w.many = true;
            }
            w.expansion(quoted);
        }
        "command_substitution" | "arithmetic_expansion" => {
            w.at_start = false;
            w.expansion(quoted);
        }
        "brace_expression" | "extglob_pattern" | "array" => {
            w.at_start = false;
            w.many = true;
        }
        other => {
            let why = format!("a word of a kind the walker does not know ({other})");
            if !unsure.contains(&why) {
                unsure.push(why);
            }
            w.unquoted(text(node, b));
        }
    }
}

/// The named children of `node` in `start..end`, with the text between them as literal text.
fn gaps(
    node: Node,
    b: &[u8],
    start: usize,
    end: usize,
    quoted: bool,
    w: &mut Builder,
    unsure: &mut Vec<String>,
) {
    let mut at = start;
    let mut cursor = node.walk();
    for child in node.named_children(&mut cursor) {
        if child.start_byte() > at {
            let gap = std::str::from_utf8(&b[at..child.start_byte()]).unwrap_or("");
            lit(gap, quoted, w);
        }
        piece(child, b, quoted, w, unsure);
        at = child.end_byte();
    }
    if end > at {
        let gap = std::str::from_utf8(&b[at..end]).unwrap_or("");
        lit(gap, quoted, w);
    }
}

fn lit(s: &str, quoted: bool, w: &mut Builder) {
    if quoted {
        w.double_quoted(s);
    } else {
        w.unquoted(s);
    }
}
