//! A failed Rust test's output, as libtest and nextest print it: the `thread '..' panicked at
//! file:line:col:` line, the message after it (an assertion's `left`/`right`), and a backtrace's
//! frames inside the workspace.

use super::{Excerpt, file_line, inside};
use crate::Sink;

/// Most message lines after the panic line kept in the excerpt.
const MESSAGE_LINES: usize = 10;
/// Most backtrace frames kept in the excerpt.
const FRAMES: usize = 3;

#[derive(Default)]
pub(crate) struct RustFailure {
    place: Option<(String, u32, Option<u32>)>,
    place_inside: bool,
    frame: Option<(String, u32, Option<u32>)>,
    pub(crate) message: Option<String>,
    fallback: Option<String>,
    pub(crate) excerpt: Excerpt,
    /// Message lines still to read after the panic line.
    message_left: usize,
    backtrace: bool,
    last_fn: Option<String>,
    frames: usize,
}

impl RustFailure {
    /// One line of the failure's output, without the indentation its runner added.
    pub(crate) fn line(&mut self, t: &str, sink: &Sink) {
        if let Some(at) = t.find("panicked at ")
            && t.starts_with("thread '")
        {
            self.panic(t, &t[at + "panicked at ".len()..], sink);
            return;
        }
        if self.message_left > 0 {
            if t.is_empty() || t.starts_with("note: ") || t == "stack backtrace:" {
                self.message_left = 0;
            } else {
                self.message_left -= 1;
                if self.message.is_none() {
                    self.message = Some(t.to_string());
                }
                self.excerpt.push(t);
                return;
            }
        }
        if t == "stack backtrace:" {
            self.backtrace = true;
            return;
        }
        if self.backtrace {
            let s = t.trim_start();
            if let Some(path) = s.strip_prefix("at ") {
                if let Some((file, n, col, _)) = file_line(path)
                    && !file.starts_with("/rustc/")
                    && inside(sink, file)
                {
                    if self.frame.is_none() {
                        self.frame = Some((file.to_string(), n, col));
                    }
                    if self.frames < FRAMES {
                        self.frames += 1;
                        let f = self.last_fn.take().unwrap_or_default();
                        self.excerpt.push(&format!("  {f} at {path}"));
                    }
                }
            } else if let Some((_, f)) = s.split_once(": ")
                && s.starts_with(|c: char| c.is_ascii_digit())
            {
                self.last_fn = Some(f.to_string());
            }
            return;
        }
        if self.fallback.is_none()
            && (t.starts_with("Error: ") || t.starts_with("error: ") || t.starts_with("error["))
        {
            self.fallback = Some(t.to_string());
            self.excerpt.push(t);
        }
    }

    fn panic(&mut self, t: &str, rest: &str, sink: &Sink) {
        if self.place.is_some() {
            // A second panic (in a drop, another thread): the first one tells.
            return;
        }
        self.excerpt.push(t);
        let rest = rest.trim_end();
        if let Some(quoted) = rest.strip_prefix('\'') {
            // Before Rust 1.73: `panicked at 'message', src/lib.rs:12:5`.
            if let Some((msg, place)) = quoted.rsplit_once("', ") {
                self.message = Some(msg.to_string());
                self.set_place(place, sink);
            }
            return;
        }
        self.set_place(rest, sink);
        self.message_left = MESSAGE_LINES;
    }

    fn set_place(&mut self, s: &str, sink: &Sink) {
        if let Some((file, n, col, _)) = file_line(s) {
            self.place_inside = inside(sink, file);
            self.place = Some((file.to_string(), n, col));
        }
    }

    /// The failure's place: the panic's when inside the workspace, else the first frame that
    /// is, else the panic's.
    pub(crate) fn place(&self) -> Option<&(String, u32, Option<u32>)> {
        if self.place_inside {
            return self.place.as_ref();
        }
        self.frame.as_ref().or(self.place.as_ref())
    }

    pub(crate) fn message(&self) -> Option<&str> {
        self.message.as_deref().or(self.fallback.as_deref())
    }
}
