//! A static reading of shell scripts for the command policy: which simple commands a script
//! would run, word by word, and what a reading without running it cannot know.
//!
//! This is not a shell and expands nothing. It reads POSIX `sh` syntax with the bash extensions
//! agents commonly write: it removes quotes (`g""it` is `git`), marks words whose text depends on
//! an expansion, and finds every simple command in lists (`;`, `&&`, `||`, `&`, newlines),
//! pipelines, subshells, `{ }` groups, `if`/`while`/`until`/`for`/`case` bodies, function bodies,
//! and inside command substitutions (`$(..)`, backticks) and process substitutions (`<(..)`).
//!
//! What it cannot read with confidence is reported in [`Script::unsure`] (the command policy
//! treats it as needing approval): syntax it does not know or that is malformed (unbalanced
//! quotes or parentheses), here-documents whose text runs commands, commands hidden in
//! `${..}` or `$((..))`, `for ((..))` loops, `coproc`, and scripts nested too deeply.

use std::mem;

/// How deep substitutions may nest before the reader gives up (and says so).
const MAX_DEPTH: usize = 16;

/// One word of a simple command, as far as a reading without running it can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Word {
    /// Literal text, after quote removal.
    Lit(String),
    /// Exactly one word whose text depends on an expansion (a quoted `"$X"`, `~`, `$'..'`).
    /// `base` is the part after the last `/` when that part is literal: `"$HOME"/bin/git` has
    /// the base `git`.
    One { base: Option<String> },
    /// Any number of words, zero included: an unquoted expansion or a pattern, split and
    /// globbed when the command runs (`$X`, `$(cmd)`, `*.rs`, `{a,b}`, `"$@"`).
    Many,
}

impl Word {
    /// The literal text, when the word is literal.
    pub fn lit(&self) -> Option<&str> {
        match self {
            Word::Lit(s) => Some(s),
            _ => None,
        }
    }
}

/// What a script runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Script {
    /// Every simple command, in the order they appear (substitutions before the command that
    /// contains them). Assignments and redirections are left out.
    pub commands: Vec<Vec<Word>>,
    /// Why the reading may be incomplete; empty when the whole script was understood.
    pub unsure: Vec<String>,
}

/// Reads `src` as a shell script.
pub fn parse(src: &str) -> Script {
    parse_at(src, 0)
}

fn parse_at(src: &str, depth: usize) -> Script {
    let mut p = Parser::new(src, depth);
    if let Err(why) = p.parse_list(false) {
        p.out.unsure.push(why);
    }
    p.out
}

/// Splits `src` into literal words the way the shell would (quotes removed), refusing anything
/// that is not plain words: operators, redirections, expansions, patterns, comments.
pub fn split_words(src: &str) -> Result<Vec<String>, String> {
    let mut p = Parser::new(src, 0);
    let mut words = Vec::new();
    loop {
        match p.next_tok()? {
            Tok::Eof => break,
            Tok::Word(w) => match w.word {
                Word::Lit(s) => words.push(s),
                _ => {
                    return Err(
                        "it contains an expansion or a pattern (such as $X, $(..), ~, * or \
                         {a,b}); quote it, or write the prefix as a list of words"
                            .to_owned(),
                    );
                }
            },
            Tok::Newline => return Err("it spans several lines".to_owned()),
            Tok::Op(op) | Tok::Redir(op) => {
                return Err(format!(
                    "it contains the shell operator {op:?}; a prefix is one command's words"
                ));
            }
        }
        if p.saw_comment {
            return Err("it contains a comment (#); quote the #".to_owned());
        }
    }
    if p.saw_comment {
        return Err("it contains a comment (#); quote the #".to_owned());
    }
    if !p.out.commands.is_empty() || !p.out.unsure.is_empty() {
        return Err("it contains a command substitution".to_owned());
    }
    Ok(words)
}

/// A lexed word with what the parser needs to know about its spelling.
#[derive(Debug)]
struct Lexed {
    word: Word,
    /// The literal characters (quotes removed, expansions left out).
    text: String,
    /// Some part was quoted or escaped (so it is no reserved word, and a quoted here-document
    /// delimiter).
    quoted: bool,
    /// `NAME=value` or `NAME+=value`.
    assignment: bool,
    /// Digits or `{name}` right before `<` or `>`: the descriptor of a redirection.
    io_number: bool,
}

#[derive(Debug)]
enum Tok {
    Word(Lexed),
    /// `;` `&` `&&` `||` `|` `|&` `(` `)` `;;` `;&` `;;&`
    Op(&'static str),
    /// `<` `>` `>>` `<<` `<<-` `<<<` `<&` `>&` `<>` `>|` `&>` `&>>`
    Redir(&'static str),
    Newline,
    Eof,
}

#[derive(Debug)]
struct Heredoc {
    delimiter: String,
    strip_tabs: bool,
    /// Unquoted delimiter: the body is expanded (and may run commands).
    expands: bool,
}

/// Where the parser is in a compound command's syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Normal,
    /// After `case`: the word.
    CaseWord,
    /// After `case WORD`: `in`.
    CaseIn,
    /// Patterns up to `)`.
    CasePattern,
    /// After `for`/`select`: the name.
    ForName,
    /// After `for NAME`: `in`, `do`, or a separator.
    ForIn,
    /// The words after `in`, up to a separator.
    ForWords,
    /// After `function`: the name.
    FuncName,
    /// After the function's name: optional `()`, then the body.
    FuncAfterName,
    /// Inside `[[ .. ]]`.
    Test,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ctx {
    Paren,
    Case,
}

struct Parser {
    s: Vec<char>,
    pos: usize,
    depth: usize,
    out: Script,
    heredocs: Vec<Heredoc>,
    unread: Option<Tok>,
    saw_comment: bool,
}

impl Parser {
    fn new(src: &str, depth: usize) -> Parser {
        Parser {
            s: src.chars().collect(),
            pos: 0,
            depth,
            out: Script::default(),
            heredocs: Vec::new(),
            unread: None,
            saw_comment: false,
        }
    }

    fn peek(&self) -> Option<char> {
        self.s.get(self.pos).copied()
    }

    fn peek_at(&self, n: usize) -> Option<char> {
        self.s.get(self.pos + n).copied()
    }

    fn unsure(&mut self, why: impl Into<String>) {
        let why = why.into();
        if !self.out.unsure.contains(&why) {
            self.out.unsure.push(why);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Grammar
    // -----------------------------------------------------------------------------------------

    /// Reads commands up to the end, or with `close` up to the `)` that ends a `$(`.
    fn parse_list(&mut self, close: bool) -> Result<(), String> {
        let mut cmd: Vec<Word> = Vec::new();
        let mut at_start = true;
        let mut mode = Mode::Normal;
        let mut ctx: Vec<Ctx> = Vec::new();
        loop {
            let tok = match self.unread.take() {
                Some(t) => t,
                None => self.next_tok()?,
            };
            if let Tok::Eof = tok {
                self.finish(&mut cmd);
                if close {
                    return Err("a $( .. ) is not closed".to_owned());
                }
                if !ctx.is_empty() || mode != Mode::Normal {
                    return Err("the script ends inside a compound command".to_owned());
                }
                return Ok(());
            }
            match mode {
                Mode::Normal => {}
                Mode::Test => {
                    if let Tok::Word(w) = &tok
                        && !w.quoted
                        && w.word.lit() == Some("]]")
                    {
                        mode = Mode::Normal;
                    }
                    continue;
                }
                Mode::CaseWord => {
                    if !matches!(tok, Tok::Word(_)) {
                        return Err("case without a word".to_owned());
                    }
                    mode = Mode::CaseIn;
                    continue;
                }
                Mode::CaseIn => match tok {
                    Tok::Newline => continue,
                    Tok::Word(w) if w.word.lit() == Some("in") => {
                        ctx.push(Ctx::Case);
                        mode = Mode::CasePattern;
                        continue;
                    }
                    _ => return Err("case without in".to_owned()),
                },
                Mode::CasePattern => match tok {
                    Tok::Word(w) if !w.quoted && w.word.lit() == Some("esac") => {
                        if ctx.pop() != Some(Ctx::Case) {
                            return Err("esac without case".to_owned());
                        }
                        mode = Mode::Normal;
                        at_start = true;
                        continue;
                    }
                    Tok::Word(_) | Tok::Newline | Tok::Op("|") | Tok::Op("(") => continue,
                    Tok::Op(")") => {
                        mode = Mode::Normal;
                        at_start = true;
                        continue;
                    }
                    _ => return Err("unexpected syntax in a case pattern".to_owned()),
                },
                Mode::ForName => match tok {
                    Tok::Word(_) => {
                        mode = Mode::ForIn;
                        continue;
                    }
                    Tok::Op("(") => {
                        return Err("for (( .. )) loops are not analysed".to_owned());
                    }
                    _ => return Err("for without a name".to_owned()),
                },
                Mode::ForIn => match tok {
                    Tok::Newline | Tok::Op(";") => {
                        mode = Mode::Normal;
                        at_start = true;
                        continue;
                    }
                    Tok::Word(w) if w.word.lit() == Some("in") => {
                        mode = Mode::ForWords;
                        continue;
                    }
                    Tok::Word(w) if w.word.lit() == Some("do") => {
                        mode = Mode::Normal;
                        at_start = true;
                        continue;
                    }
                    _ => return Err("unexpected syntax after for NAME".to_owned()),
                },
                Mode::ForWords => match tok {
                    Tok::Word(_) => continue,
                    Tok::Newline | Tok::Op(";") => {
                        mode = Mode::Normal;
                        at_start = true;
                        continue;
                    }
                    _ => return Err("unexpected syntax in a for list".to_owned()),
                },
                Mode::FuncName => {
                    if !matches!(tok, Tok::Word(_)) {
                        return Err("function without a name".to_owned());
                    }
                    mode = Mode::FuncAfterName;
                    continue;
                }
                Mode::FuncAfterName => {
                    mode = Mode::Normal;
                    at_start = true;
                    match tok {
                        Tok::Op("(") => {
                            self.expect_close_paren()?;
                            continue;
                        }
                        Tok::Newline => {
                            mode = Mode::FuncAfterName;
                            continue;
                        }
                        // The body: read it as usual.
                        other => self.unread = Some(other),
                    }
                    continue;
                }
            }

            match tok {
                // Handled before the match.
                Tok::Eof => {}
                Tok::Word(w) => {
                    if w.io_number {
                        continue;
                    }
                    if at_start && !w.quoted {
                        match w.word.lit() {
                            Some(
                                "if" | "then" | "else" | "elif" | "do" | "while" | "until" | "!"
                                | "{" | "fi" | "done" | "}",
                            ) => continue,
                            Some("esac") => {
                                if ctx.pop() != Some(Ctx::Case) {
                                    return Err("esac without case".to_owned());
                                }
                                continue;
                            }
                            Some("case") => {
                                mode = Mode::CaseWord;
                                continue;
                            }
                            Some("for" | "select") => {
                                mode = Mode::ForName;
                                continue;
                            }
                            Some("function") => {
                                mode = Mode::FuncName;
                                continue;
                            }
                            Some("[[") => {
                                mode = Mode::Test;
                                continue;
                            }
                            Some("coproc") => {
                                self.unsure("coproc is not analysed");
                                continue;
                            }
                            _ => {}
                        }
                    }
                    if at_start && w.assignment {
                        continue;
                    }
                    cmd.push(w.word);
                    at_start = false;
                }
                Tok::Redir(op) => {
                    let target = match self.next_tok()? {
                        Tok::Word(t) => t,
                        _ => return Err(format!("the redirection {op} has no target")),
                    };
                    if op == "<<" || op == "<<-" {
                        self.heredocs.push(Heredoc {
                            delimiter: target.text,
                            strip_tabs: op == "<<-",
                            expands: !target.quoted,
                        });
                    }
                }
                Tok::Newline | Tok::Op(";" | "&" | "&&" | "||" | "|" | "|&") => {
                    self.finish(&mut cmd);
                    at_start = true;
                }
                Tok::Op("(") => {
                    if at_start && cmd.is_empty() {
                        ctx.push(Ctx::Paren);
                    } else if cmd.len() == 1 {
                        // NAME ( ) BODY: a function definition.
                        self.expect_close_paren()?;
                        cmd.clear();
                        at_start = true;
                    } else {
                        return Err("unexpected (".to_owned());
                    }
                }
                Tok::Op(")") => {
                    self.finish(&mut cmd);
                    at_start = true;
                    match ctx.last() {
                        Some(Ctx::Paren) => {
                            ctx.pop();
                        }
                        Some(Ctx::Case) => return Err("unexpected ) in a case body".to_owned()),
                        None if close => return Ok(()),
                        None => return Err("unbalanced )".to_owned()),
                    }
                }
                Tok::Op(";;" | ";&" | ";;&") => {
                    self.finish(&mut cmd);
                    at_start = true;
                    if ctx.last() != Some(&Ctx::Case) {
                        return Err(";; outside a case".to_owned());
                    }
                    mode = Mode::CasePattern;
                }
                Tok::Op(op) => return Err(format!("unexpected {op}")),
            }
        }
    }

    fn expect_close_paren(&mut self) -> Result<(), String> {
        match self.next_tok()? {
            Tok::Op(")") => Ok(()),
            _ => Err("unexpected (".to_owned()),
        }
    }

    fn finish(&mut self, cmd: &mut Vec<Word>) {
        if !cmd.is_empty() {
            self.out.commands.push(mem::take(cmd));
        }
    }

    /// Reads a nested script up to its closing `)` (`$(..)`, `<(..)`), adding its commands.
    fn nested(&mut self) -> Result<(), String> {
        if self.depth >= MAX_DEPTH {
            return Err("substitutions are nested too deeply to analyse".to_owned());
        }
        // The nested list has its own compound-command state but shares the input.
        self.depth += 1;
        let saved_unread = self.unread.take();
        let r = self.parse_list(true);
        self.unread = saved_unread;
        self.depth -= 1;
        r
    }

    // -----------------------------------------------------------------------------------------
    // Tokens
    // -----------------------------------------------------------------------------------------

    fn next_tok(&mut self) -> Result<Tok, String> {
        loop {
            match self.peek() {
                Some(' ' | '\t' | '\r') => self.pos += 1,
                Some('\\') if self.peek_at(1) == Some('\n') => self.pos += 2,
                Some('#') => {
                    self.saw_comment = true;
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
        let Some(c) = self.peek() else {
            return Ok(Tok::Eof);
        };
        let next = self.peek_at(1);
        let next2 = self.peek_at(2);
        let (tok, len) = match (c, next, next2) {
            ('\n', _, _) => {
                self.pos += 1;
                self.read_heredocs();
                return Ok(Tok::Newline);
            }
            (';', Some(';'), Some('&')) => (Tok::Op(";;&"), 3),
            (';', Some(';'), _) => (Tok::Op(";;"), 2),
            (';', Some('&'), _) => (Tok::Op(";&"), 2),
            (';', _, _) => (Tok::Op(";"), 1),
            ('&', Some('&'), _) => (Tok::Op("&&"), 2),
            ('&', Some('>'), Some('>')) => (Tok::Redir("&>>"), 3),
            ('&', Some('>'), _) => (Tok::Redir("&>"), 2),
            ('&', _, _) => (Tok::Op("&"), 1),
            ('|', Some('|'), _) => (Tok::Op("||"), 2),
            ('|', Some('&'), _) => (Tok::Op("|&"), 2),
            ('|', _, _) => (Tok::Op("|"), 1),
            ('(', _, _) => (Tok::Op("("), 1),
            (')', _, _) => (Tok::Op(")"), 1),
            ('<' | '>', Some('('), _) => {
                // Process substitution: a command whose output or input is a file name.
                self.pos += 2;
                self.nested()?;
                return Ok(Tok::Word(Lexed {
                    word: Word::One { base: None },
                    text: String::new(),
                    quoted: false,
                    assignment: false,
                    io_number: false,
                }));
            }
            ('<', Some('<'), Some('<')) => (Tok::Redir("<<<"), 3),
            ('<', Some('<'), Some('-')) => (Tok::Redir("<<-"), 3),
            ('<', Some('<'), _) => (Tok::Redir("<<"), 2),
            ('<', Some('&'), _) => (Tok::Redir("<&"), 2),
            ('<', Some('>'), _) => (Tok::Redir("<>"), 2),
            ('<', _, _) => (Tok::Redir("<"), 1),
            ('>', Some('>'), _) => (Tok::Redir(">>"), 2),
            ('>', Some('&'), _) => (Tok::Redir(">&"), 2),
            ('>', Some('|'), _) => (Tok::Redir(">|"), 2),
            ('>', _, _) => (Tok::Redir(">"), 1),
            _ => return self.word().map(Tok::Word),
        };
        self.pos += len;
        Ok(tok)
    }

    /// Reads the bodies of the here-documents started on the line that just ended.
    fn read_heredocs(&mut self) {
        for doc in mem::take(&mut self.heredocs) {
            let mut body = String::new();
            loop {
                if self.peek().is_none() {
                    break;
                }
                let start = self.pos;
                while self.peek().is_some_and(|c| c != '\n') {
                    self.pos += 1;
                }
                let line: String = self.s[start..self.pos].iter().collect();
                if self.peek() == Some('\n') {
                    self.pos += 1;
                }
                let cmp = if doc.strip_tabs {
                    line.trim_start_matches('\t')
                } else {
                    line.as_str()
                };
                if cmp == doc.delimiter {
                    break;
                }
                body.push_str(&line);
                body.push('\n');
            }
            if doc.expands && (body.contains("$(") || body.contains('`')) {
                self.unsure(
                    "a here-document runs commands in its text ($(..) or backticks); quote its \
                     delimiter (<<'EOF') to keep the text literal",
                );
            }
        }
    }

    /// Lexes one word: quote removal, expansions marked, substitutions read for their commands.
    fn word(&mut self) -> Result<Lexed, String> {
        let start = self.pos;
        let mut w = WordBuilder::default();
        // Still reading `NAME` at the word's start (for assignments).
        let mut name_prefix = true;
        let mut bracket_open = false;
        let mut brace_open = false;
        let mut brace_sep = false;
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' | '\r' | '\n' | ';' | '&' | '|' | ')' | '<' | '>' => break,
                '(' => {
                    if w.assignment && w.text.ends_with('=') && !w.quoted_any {
                        // NAME=( .. ): a bash array.
                        self.pos += 1;
                        self.array_words()?;
                        w.many = true;
                        continue;
                    }
                    break;
                }
                '\\' => {
                    name_prefix = false;
                    match self.peek_at(1) {
                        Some('\n') => self.pos += 2,
                        Some(n) => {
                            w.text.push(n);
                            w.quoted_any = true;
                            self.pos += 2;
                        }
                        None => {
                            w.text.push('\\');
                            self.pos += 1;
                        }
                    }
                }
                '\'' => {
                    name_prefix = false;
                    self.pos += 1;
                    w.quoted_any = true;
                    loop {
                        match self.peek() {
                            None => return Err("a single quote is not closed".to_owned()),
                            Some('\'') => {
                                self.pos += 1;
                                break;
                            }
                            Some(ch) => {
                                w.text.push(ch);
                                self.pos += 1;
                            }
                        }
                    }
                }
                '"' => {
                    name_prefix = false;
                    self.pos += 1;
                    w.quoted_any = true;
                    self.double_quoted(&mut w)?;
                }
                '$' => {
                    name_prefix = false;
                    self.dollar(&mut w, false)?;
                }
                '`' => {
                    name_prefix = false;
                    self.backtick(&mut w, false)?;
                }
                '~' if self.pos == start => {
                    // Tilde expansion: one word, its text unknown up to the first '/'.
                    name_prefix = false;
                    self.pos += 1;
                    while self
                        .peek()
                        .is_some_and(|c| c.is_ascii_alphanumeric() || "._-+".contains(c))
                    {
                        self.pos += 1;
                    }
                    w.expansion(true);
                }
                '=' if name_prefix && is_name(&w.text) && !w.assignment => {
                    w.assignment = true;
                    name_prefix = false;
                    w.text.push('=');
                    self.pos += 1;
                }
                '+' if name_prefix && is_name(&w.text) && self.peek_at(1) == Some('=') => {
                    w.assignment = true;
                    name_prefix = false;
                    w.text.push_str("+=");
                    self.pos += 2;
                }
                _ => {
                    if !(c.is_ascii_alphanumeric() || c == '_') {
                        name_prefix = false;
                    }
                    match c {
                        '*' | '?' => w.many = true,
                        '[' => bracket_open = true,
                        ']' if bracket_open => w.many = true,
                        '{' => brace_open = true,
                        ',' if brace_open => brace_sep = true,
                        '.' if brace_open && self.peek_at(1) == Some('.') => brace_sep = true,
                        '}' if brace_open && brace_sep => w.many = true,
                        _ => {}
                    }
                    w.text.push(c);
                    self.pos += 1;
                }
            }
        }
        let raw: String = self.s[start..self.pos].iter().collect();
        let io_number = matches!(self.peek(), Some('<' | '>'))
            && (raw.chars().all(|c| c.is_ascii_digit())
                || raw
                    .strip_prefix('{')
                    .and_then(|r| r.strip_suffix('}'))
                    .is_some_and(is_name));
        Ok(w.finish(io_number))
    }

    /// The words of a bash array assignment, up to its `)`.
    fn array_words(&mut self) -> Result<(), String> {
        loop {
            match self.next_tok()? {
                Tok::Op(")") => return Ok(()),
                Tok::Word(_) | Tok::Newline => {}
                Tok::Eof => return Err("an array assignment is not closed".to_owned()),
                _ => return Err("unexpected syntax in an array assignment".to_owned()),
            }
        }
    }

    /// After an opening `"`, up to and including the closing one.
    fn double_quoted(&mut self, w: &mut WordBuilder) -> Result<(), String> {
        loop {
            match self.peek() {
                None => return Err("a double quote is not closed".to_owned()),
                Some('"') => {
                    self.pos += 1;
                    return Ok(());
                }
                Some('\\') => match self.peek_at(1) {
                    Some('\n') => self.pos += 2,
                    Some(n @ ('$' | '`' | '"' | '\\')) => {
                        w.text.push(n);
                        self.pos += 2;
                    }
                    _ => {
                        w.text.push('\\');
                        self.pos += 1;
                    }
                },
                Some('$') => self.dollar(w, true)?,
                Some('`') => self.backtick(w, true)?,
                Some(ch) => {
                    w.text.push(ch);
                    self.pos += 1;
                }
            }
        }
    }

    /// At a `$`: an expansion, or a literal `$`.
    fn dollar(&mut self, w: &mut WordBuilder, quoted: bool) -> Result<(), String> {
        match self.peek_at(1) {
            Some('(') if self.peek_at(2) == Some('(') => {
                self.pos += 3;
                let inner = self.balanced('(', ')', "$((")?;
                // The arithmetic ends with "))": the scan stopped after the first one.
                if self.peek() == Some(')') {
                    self.pos += 1;
                }
                if inner.contains("$(") || inner.contains('`') {
                    self.unsure("a command inside $(( .. )) is not analysed");
                }
                w.expansion(quoted);
            }
            Some('(') => {
                self.pos += 2;
                self.nested()?;
                w.expansion(quoted);
            }
            Some('{') => {
                self.pos += 2;
                let inner = self.balanced('{', '}', "${")?;
                if inner.contains("$(") || inner.contains('`') {
                    self.unsure("a command inside ${ .. } is not analysed");
                }
                if inner.starts_with('@') || inner.starts_with('*') || inner.contains("[@]") {
                    w.many = true;
                }
                w.expansion(quoted);
            }
            Some('\'') if !quoted => {
                // bash's $'..': escapes make any text, so it is one word of unknown text.
                self.pos += 2;
                loop {
                    match self.peek() {
                        None => return Err("a $' quote is not closed".to_owned()),
                        Some('\\') => self.pos += 2,
                        Some('\'') => {
                            self.pos += 1;
                            break;
                        }
                        Some(_) => self.pos += 1,
                    }
                }
                w.quoted_any = true;
                w.expansion(true);
            }
            Some('"') if !quoted => {
                // bash's $"..": a translated string.
                self.pos += 2;
                w.quoted_any = true;
                self.double_quoted(w)?;
                w.expansion(true);
            }
            Some('@' | '*') => {
                self.pos += 2;
                w.many = true;
                w.expansion(quoted);
            }
            Some(c) if c.is_ascii_digit() || "#?$!-".contains(c) => {
                self.pos += 2;
                w.expansion(quoted);
            }
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {
                self.pos += 1;
                while self
                    .peek()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    self.pos += 1;
                }
                w.expansion(quoted);
            }
            _ => {
                w.text.push('$');
                self.pos += 1;
            }
        }
        Ok(())
    }

    /// Text up to the `close` matching an `open` already consumed; quotes are skipped over.
    fn balanced(&mut self, open: char, close: char, what: &str) -> Result<String, String> {
        let start = self.pos;
        let mut depth = 1usize;
        while let Some(c) = self.peek() {
            match c {
                '\\' => self.pos += 1,
                '\'' if open == '{' => {
                    self.pos += 1;
                    while self.peek().is_some_and(|c| c != '\'') {
                        self.pos += 1;
                    }
                }
                c if c == open => depth += 1,
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        let inner = self.s[start..self.pos].iter().collect();
                        self.pos += 1;
                        return Ok(inner);
                    }
                }
                _ => {}
            }
            self.pos += 1;
        }
        Err(format!("a {what} is not closed"))
    }

    /// At a backtick: the old form of command substitution. Its text is read as a script.
    fn backtick(&mut self, w: &mut WordBuilder, quoted: bool) -> Result<(), String> {
        self.pos += 1;
        let mut inner = String::new();
        loop {
            match self.peek() {
                None => return Err("a backtick is not closed".to_owned()),
                Some('`') => {
                    self.pos += 1;
                    break;
                }
                Some('\\') => match self.peek_at(1) {
                    Some(n @ ('`' | '\\' | '$')) => {
                        inner.push(n);
                        self.pos += 2;
                    }
                    Some('"') if quoted => {
                        inner.push('"');
                        self.pos += 2;
                    }
                    _ => {
                        inner.push('\\');
                        self.pos += 1;
                    }
                },
                Some(c) => {
                    inner.push(c);
                    self.pos += 1;
                }
            }
        }
        if self.depth >= MAX_DEPTH {
            return Err("substitutions are nested too deeply to analyse".to_owned());
        }
        let sub = parse_at(&inner, self.depth + 1);
        self.out.commands.extend(sub.commands);
        for why in sub.unsure {
            self.unsure(why);
        }
        w.expansion(quoted);
        Ok(())
    }
}

#[derive(Debug, Default)]
struct WordBuilder {
    text: String,
    quoted_any: bool,
    assignment: bool,
    /// Splits into any number of words.
    many: bool,
    /// Has an expansion that keeps it one word.
    one: bool,
    /// `text.len()` at the last expansion.
    last_expansion: Option<usize>,
}

impl WordBuilder {
    fn expansion(&mut self, quoted: bool) {
        if quoted {
            self.one = true;
        } else {
            self.many = true;
        }
        self.last_expansion = Some(self.text.len());
    }

    fn finish(self, io_number: bool) -> Lexed {
        let word = if self.many {
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
            Word::Lit(self.text.clone())
        };
        Lexed {
            word,
            text: self.text,
            quoted: self.quoted_any,
            assignment: self.assignment,
            io_number,
        }
    }
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lit(s: &str) -> Word {
        Word::Lit(s.to_owned())
    }

    /// The commands of `src` as strings: literal words as they are, others as <1> or <*>.
    fn cmds(src: &str) -> Vec<String> {
        let script = parse(src);
        assert!(script.unsure.is_empty(), "{src:?}: {:?}", script.unsure);
        show(&script)
    }

    fn show(script: &Script) -> Vec<String> {
        script
            .commands
            .iter()
            .map(|c| {
                c.iter()
                    .map(|w| match w {
                        Word::Lit(s) => s.clone(),
                        Word::One { base: Some(b) } => format!("<1:{b}>"),
                        Word::One { base: None } => "<1>".to_owned(),
                        Word::Many => "<*>".to_owned(),
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    fn unsure(src: &str) -> Vec<String> {
        parse(src).unsure
    }

    #[test]
    fn lists_and_pipelines() {
        assert_eq!(
            cmds("true && git push; ls | wc -l & echo a || echo b\ncargo test"),
            [
                "true",
                "git push",
                "ls",
                "wc -l",
                "echo a",
                "echo b",
                "cargo test"
            ]
        );
        assert_eq!(cmds("a |& b"), ["a", "b"]);
        assert_eq!(cmds(""), Vec::<String>::new());
        assert_eq!(cmds("  # only a comment\n"), Vec::<String>::new());
    }

    #[test]
    fn quote_removal() {
        assert_eq!(cmds(r#"g""it push"#), ["git push"]);
        assert_eq!(cmds("'git' push"), ["git push"]);
        assert_eq!(cmds(r"\git pu\sh"), ["git push"]);
        assert_eq!(cmds(r#""git push""#), ["git push"]);
        assert_eq!(
            parse(r#""git push""#).commands,
            [vec![lit("git push")]],
            "one word"
        );
        assert_eq!(cmds("gi\\\nt push"), ["git push"]);
        assert_eq!(cmds(r#"echo "a \"b\" \$c""#), [r#"echo a "b" $c"#]);
        assert_eq!(cmds("echo a$"), ["echo a$"]);
    }

    #[test]
    fn expansions_make_words_unknown() {
        assert_eq!(cmds("$(echo git) push"), ["echo git", "<*> push"]);
        assert_eq!(cmds("`echo git` push"), ["echo git", "<*> push"]);
        assert_eq!(cmds("\"$(echo git)\" push"), ["echo git", "<1> push"]);
        assert_eq!(cmds("$X push"), ["<*> push"]);
        assert_eq!(cmds("\"$X\" push"), ["<1> push"]);
        assert_eq!(cmds("\"$HOME\"/bin/git push"), ["<1:git> push"]);
        assert_eq!(cmds("\"${HOME}/bin/git\" push"), ["<1:git> push"]);
        assert_eq!(cmds("~/bin/git push"), ["<1:git> push"]);
        assert_eq!(cmds("$HOME/bin/git push"), ["<*> push"], "may split");
        assert_eq!(cmds("\"$d/$x\" push"), ["<1> push"]);
        assert_eq!(cmds("git $'push'"), ["git <1>"]);
        assert_eq!(cmds("g?t push"), ["<*> push"]);
        assert_eq!(cmds("/usr/bin/g[i]t push"), ["<*> push"]);
        assert_eq!(cmds("g{i,}t push"), ["<*> push"]);
        assert_eq!(cmds("echo {} [ ] a{b}"), ["echo {} [ ] a{b}"]);
        assert_eq!(cmds("git \"$@\""), ["git <*>"]);
        assert_eq!(cmds("echo $((1 + 2))"), ["echo <*>"]);
    }

    #[test]
    fn substitutions_are_read_for_their_commands() {
        assert_eq!(cmds("echo $(git push)"), ["git push", "echo <*>"]);
        assert_eq!(
            cmds("echo \"$(a \"$(b)\")\" `c`"),
            ["b", "a <1>", "c", "echo <1> <*>"]
        );
        assert_eq!(cmds("x=$(git push) true"), ["git push", "true"]);
        assert_eq!(
            cmds("diff <(git show) >(tee x)"),
            ["git show", "tee x", "diff <1> <1>"]
        );
        assert_eq!(
            cmds("echo `echo \\`git push\\``"),
            ["git push", "echo <*>", "echo <*>"]
        );
        assert_eq!(
            cmds("echo $(case x in a) git push;; esac)"),
            ["git push", "echo <*>"]
        );
    }

    #[test]
    fn compound_commands() {
        assert_eq!(
            cmds("if true; then git push; elif x; then y; else z; fi"),
            ["true", "git push", "x", "y", "z"]
        );
        assert_eq!(
            cmds("while read l; do echo $l; done < f"),
            ["read l", "echo <*>"]
        );
        assert_eq!(cmds("until false; do :; done"), ["false", ":"]);
        assert_eq!(
            cmds("for f in a $(ls) *.rs; do git add $f; done"),
            ["ls", "git add <*>"]
        );
        assert_eq!(cmds("for f\ndo echo; done"), ["echo"]);
        assert_eq!(
            cmds("(cd x && git push) | cat"),
            ["cd x", "git push", "cat"]
        );
        assert_eq!(cmds("((git push))"), ["git push"]);
        assert_eq!(cmds("{ git push; }"), ["git push"]);
        assert_eq!(
            cmds("case $x in a|b) git push;; (c) echo c;; *) ;; esac; ls"),
            ["git push", "echo c", "ls"]
        );
        assert_eq!(cmds("case x in a) echo\nesac"), ["echo"]);
        assert_eq!(cmds("f() { git push; }; f"), ["git push", "f"]);
        assert_eq!(cmds("function f { git push; }"), ["git push"]);
        assert_eq!(cmds("function f() (git push)"), ["git push"]);
        assert_eq!(cmds("! git push"), ["git push"]);
        assert_eq!(
            cmds("[[ -n $(git push) && x < y ]] && ok"),
            ["git push", "ok"]
        );
        assert_eq!(cmds("echo if then fi"), ["echo if then fi"]);
        assert_eq!(
            cmds("'if' x"),
            ["if x"],
            "a quoted word is no reserved word"
        );
    }

    #[test]
    fn assignments_and_redirections_are_not_words() {
        assert_eq!(cmds("A=1 B=\"x y\" git push"), ["git push"]);
        assert_eq!(cmds("X+=1 git push"), ["git push"]);
        assert_eq!(cmds("A=1"), Vec::<String>::new());
        assert_eq!(cmds("arr=(a $(git push) b) true"), ["git push", "true"]);
        assert_eq!(
            cmds("git push >out 2>&1 </dev/null 3<>f &>>log {fd}>x"),
            ["git push"]
        );
        assert_eq!(cmds(">out git push"), ["git push"]);
        assert_eq!(cmds("echo a=b"), ["echo a=b"]);
        assert_eq!(cmds("cat <<< \"$(git push)\""), ["git push", "cat"]);
        assert_eq!(cmds("echo 2 > x"), ["echo 2"]);
    }

    #[test]
    fn heredocs() {
        assert_eq!(
            cmds("cat <<EOF\nhello $USER\nEOF\ngit push"),
            ["cat", "git push"]
        );
        assert_eq!(
            cmds("cat <<'EOF' | sh\n$(git push)\nEOF\nls"),
            ["cat", "sh", "ls"]
        );
        assert_eq!(cmds("cat <<-E\n\tx\n\tE\nls"), ["cat", "ls"]);
        assert!(!unsure("cat <<EOF\n$(git push)\nEOF\n").is_empty());
        assert!(!unsure("cat <<EOF\n`git push`\nEOF\n").is_empty());
    }

    #[test]
    fn what_cannot_be_read_is_unsure() {
        for src in [
            "echo 'unclosed",
            "echo \"unclosed",
            "echo $(unclosed",
            "echo `unclosed",
            "(echo",
            "echo )",
            "echo ${x:-$(git push)}",
            "echo $(( $(git push) ))",
            "for ((i=0; i<3; i++)); do git push; done",
            "coproc git push",
            "case x",
            ";; echo",
            "echo (",
        ] {
            assert!(!unsure(src).is_empty(), "{src:?} should be unsure");
        }
        let deep = format!("{}git push{}", "$(".repeat(40), ")".repeat(40));
        let script = parse(&deep);
        assert!(!script.unsure.is_empty());
    }

    #[test]
    fn commands_before_a_syntax_error_are_kept() {
        let script = parse("git push; echo 'oops");
        assert_eq!(show(&script), ["git push"]);
        assert_eq!(script.unsure.len(), 1);
    }

    /// Random scripts over the characters that matter to the reader: it must end, without a
    /// panic, on anything (a cheap stand-in for a fuzz target).
    #[test]
    fn any_input_is_read_without_panicking() {
        const ALPHABET: &[&str] = &[
            " ", "\n", "\t", "'", "\"", "\\", "$", "(", ")", "{", "}", "[", "]", "`", ";", "&",
            "|", "<", ">", "#", "=", "*", "?", "~", ",", ".", "-", "a", "git", "push", "if",
            "then", "fi", "case", "in", "esac", ";;", "for", "do", "done", "<<", "EOF", "$(", "${",
            "$((", "[[", "]]", "function", "x=", "2>", "{a,b}", "é",
        ];
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as usize
        };
        for _ in 0..20_000 {
            let len = next() % 24;
            let src: String = (0..len)
                .map(|_| ALPHABET[next() % ALPHABET.len()])
                .collect();
            let script = parse(&src);
            assert!(script.commands.len() <= src.len() + 1, "{src:?}");
            let _ = split_words(&src);
        }
    }

    #[test]
    fn prefixes_split_like_the_shell() {
        assert_eq!(split_words("git push").unwrap(), ["git", "push"]);
        assert_eq!(split_words("  rm  -rf / ").unwrap(), ["rm", "-rf", "/"]);
        assert_eq!(
            split_words("git commit -m 'a b'").unwrap(),
            ["git", "commit", "-m", "a b"]
        );
        assert_eq!(split_words("'*'").unwrap(), ["*"]);
        assert_eq!(split_words("").unwrap(), Vec::<String>::new());
        for bad in [
            "git push; rm",
            "a && b",
            "a | b",
            "a > f",
            "$X",
            "a*",
            "`x`",
            "$(x)",
            "a\nb",
            "'open",
            "git # comment",
            "~/x",
        ] {
            assert!(split_words(bad).is_err(), "{bad:?}");
        }
    }
}
