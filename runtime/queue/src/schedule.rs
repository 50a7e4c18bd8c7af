//! Recurring tasks: a schedule makes one task per window (`--every 1h`: windows start at the
//! multiples of an hour since the epoch; `--cron EXPR`: at each time the expression matches, in
//! UTC), however many workers see the tick.
//!
//! Every worker looks at the schedules about once a second. For each, the window that `now`
//! falls in is decided once, by compare-and-set on the schedule's window entry (`win.NAME` in
//! the bucket): the worker whose write lands submits the window's task with the idempotency key
//! `schedule/NAME/WINDOW`, and records its id. One that dies in between leaves the entry
//! `pending`, and the next worker to look submits with the same key: the same task. So a window
//! gets exactly one task, or is skipped by the overlap rule, and never two.
//!
//! Overlap: `skip` (the default) gives a window no task while the previous window's task has
//! not ended; `queue` gives it one that starts only when that task has ended.
//! Only the current window fires: windows that passed while no worker ran are not made up.

use std::str::FromStr;
use std::time::Duration;

use async_nats::jetstream::kv;
use chrono::TimeZone;
use croner::Cron;
use croner::parser::{CronParser, Seconds};
use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Queue, QueueError, TaskSpec, js_err};

/// When a schedule's windows start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleTiming {
    /// Every `ms` milliseconds, from the epoch.
    Every { ms: u64 },
    /// At the times a cron expression matches (5 fields, or 6 with seconds first), in UTC.
    Cron { expr: String },
}

impl ScheduleTiming {
    /// Checks the timing: a period of at least a second, a cron expression that parses.
    pub fn check(&self) -> Result<(), QueueError> {
        match self {
            ScheduleTiming::Every { ms } if *ms < 1000 => Err(QueueError::Invalid {
                what: "schedule",
                why: "--every must be at least 1s".into(),
            }),
            ScheduleTiming::Every { .. } => Ok(()),
            ScheduleTiming::Cron { expr } => parse_cron(expr).map(|_| ()),
        }
    }

    /// The start (unix ms) of the window `now_ms` falls in.
    pub fn window_at(&self, now_ms: u64) -> Result<u64, QueueError> {
        match self {
            ScheduleTiming::Every { ms } => Ok(now_ms / ms.max(&1) * ms),
            ScheduleTiming::Cron { expr } => {
                let cron = parse_cron(expr)?;
                // Cron has whole seconds: the search keeps a fraction it is given.
                let now = chrono::Utc
                    .timestamp_millis_opt((now_ms / 1000 * 1000) as i64)
                    .single()
                    .ok_or_else(|| QueueError::Invalid {
                        what: "schedule",
                        why: format!("{now_ms} is not a time"),
                    })?;
                let prev =
                    cron.find_previous_occurrence(&now, true)
                        .map_err(|e| QueueError::Invalid {
                            what: "schedule",
                            why: format!("cron {expr:?} has no time before now: {e}"),
                        })?;
                Ok(prev.timestamp_millis().max(0) as u64)
            }
        }
    }
}

fn parse_cron(expr: &str) -> Result<Cron, QueueError> {
    // Five fields, or six with seconds first (`Cron::from_str` takes five only).
    CronParser::builder()
        .seconds(Seconds::Optional)
        .build()
        .parse(expr)
        .map_err(|e| QueueError::Invalid {
            what: "schedule",
            why: format!("cron expression {expr:?}: {e}"),
        })
}

/// What a window whose previous task still runs gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// No task.
    #[default]
    Skip,
    /// A task that starts once the previous one has ended.
    Queue,
}

impl FromStr for Overlap {
    type Err = QueueError;
    fn from_str(s: &str) -> Result<Overlap, QueueError> {
        match s {
            "skip" => Ok(Overlap::Skip),
            "queue" => Ok(Overlap::Queue),
            other => Err(QueueError::Invalid {
                what: "overlap rule",
                why: format!("{other:?}: use skip or queue"),
            }),
        }
    }
}

/// A recurring task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub name: String,
    pub timing: ScheduleTiming,
    /// Each window's task (its `schedule` set per window).
    pub spec: TaskSpec,
    #[serde(default)]
    pub overlap: Overlap,
    pub created_unix_ms: u64,
}

/// How a schedule's latest window was decided.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowState {
    /// The start of the latest decided window.
    pub window_unix_ms: u64,
    /// The latest window's task, or the one before when it was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// Decided, its task not yet known (its submit may have died: finish it).
    #[serde(default)]
    pub pending: bool,
    /// Windows skipped by the overlap rule so far.
    #[serde(default)]
    pub skipped: u64,
}

/// What one look at a schedule did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fired {
    /// This look submitted the window's task.
    Submitted { window_unix_ms: u64, task: String },
    /// The window's task still runs: this window gets none.
    Skipped {
        window_unix_ms: u64,
        running: String,
    },
}

fn sched_entry(name: &str) -> String {
    format!("sched.{name}")
}

fn window_entry(name: &str) -> String {
    format!("win.{name}")
}

fn check_name(name: &str) -> Result<(), QueueError> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(QueueError::Invalid {
            what: "schedule",
            why: format!("name {name:?}: use 1 to 64 letters, digits, `-` or `_`"),
        });
    }
    Ok(())
}

impl Queue {
    /// Adds a schedule; a name already used is refused.
    pub async fn add_schedule(&self, s: &Schedule) -> Result<(), QueueError> {
        check_name(&s.name)?;
        s.timing.check()?;
        s.spec.check()?;
        let value = serde_json::to_vec(s).map_err(|e| QueueError::JetStream(e.to_string()))?;
        match self
            .records
            .create(sched_entry(&s.name), value.into())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Err(QueueError::Invalid {
                what: "schedule",
                why: format!("{:?} exists already (remove it first)", s.name),
            }),
            Err(e) => Err(js_err("a schedule", e)),
        }
    }

    /// Every schedule, by name.
    pub async fn schedules(&self) -> Result<Vec<Schedule>, QueueError> {
        let keys: Vec<String> = self
            .records
            .keys()
            .await
            .map_err(|e| js_err("the schedules", e))?
            .try_collect()
            .await
            .map_err(|e| js_err("the schedules", e))?;
        let mut out = Vec::new();
        for key in keys.iter().filter(|k| k.starts_with("sched.")) {
            let Some(raw) = self
                .records
                .get(key)
                .await
                .map_err(|e| js_err("a schedule", e))?
            else {
                continue;
            };
            match serde_json::from_slice::<Schedule>(&raw) {
                Ok(s) => out.push(s),
                Err(e) => tracing::warn!(key = %key, error = %e, "a schedule cannot be read"),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes schedule `name` (its tasks stay).
    pub async fn remove_schedule(&self, name: &str) -> Result<(), QueueError> {
        check_name(name)?;
        if self
            .records
            .get(sched_entry(name))
            .await
            .map_err(|e| js_err("a schedule", e))?
            .is_none()
        {
            return Err(QueueError::NoSchedule(name.to_string()));
        }
        // The bucket refuses deletes (its history is the audit trail): a purge removes it.
        self.records
            .purge(sched_entry(name))
            .await
            .map_err(|e| js_err("a schedule", e))?;
        Ok(())
    }

    /// How schedule `name`'s windows were decided so far.
    pub async fn window_state(&self, name: &str) -> Result<Option<WindowState>, QueueError> {
        let raw = self
            .records
            .get(window_entry(name))
            .await
            .map_err(|e| js_err("a schedule's window", e))?;
        raw.map(|r| serde_json::from_slice(&r).map_err(|e| QueueError::JetStream(e.to_string())))
            .transpose()
    }

    /// Looks at schedule `s` at `now_ms`: decides its current window if no worker has, and
    /// submits its task. `None` when there was nothing to do.
    pub async fn fire(&self, s: &Schedule, now_ms: u64) -> Result<Option<Fired>, QueueError> {
        let window = s.timing.window_at(now_ms)?;
        if window < s.created_unix_ms {
            // The window the schedule was added in has begun before it: the first is the next.
            return Ok(None);
        }
        let entry = window_entry(&s.name);
        for _ in 0..32 {
            let current = self
                .records
                .entry(&entry)
                .await
                .map_err(|e| js_err("a schedule's window", e))?
                .filter(|e| e.operation == kv::Operation::Put);
            let (state, revision) = match &current {
                Some(e) => (
                    serde_json::from_slice::<WindowState>(&e.value)
                        .map_err(|e| QueueError::JetStream(e.to_string()))?,
                    Some(e.revision),
                ),
                None => (WindowState::default(), None),
            };
            if state.window_unix_ms >= window && revision.is_some() {
                if state.pending {
                    // Decided, and its submitter may have died: finish it (same key).
                    let task = self.submit_window(s, window, state.task.as_deref()).await?;
                    self.settle_window(&entry, window, &task).await?;
                }
                return Ok(None);
            }
            // Removed since the caller listed it: no more windows.
            if self
                .records
                .get(sched_entry(&s.name))
                .await
                .map_err(|e| js_err("a schedule", e))?
                .is_none()
            {
                return Ok(None);
            }
            let previous = match &state.task {
                Some(id) => self.load(id).await?.map(|(t, _)| (id.clone(), t.state)),
                None => None,
            };
            let running = previous.filter(|(_, st)| !st.is_final());
            let next = match (&running, s.overlap) {
                (Some((id, _)), Overlap::Skip) => WindowState {
                    window_unix_ms: window,
                    task: Some(id.clone()),
                    pending: false,
                    skipped: state.skipped + 1,
                },
                _ => WindowState {
                    window_unix_ms: window,
                    // While pending, the task it must run after.
                    task: running.as_ref().map(|(id, _)| id.clone()),
                    pending: true,
                    skipped: state.skipped,
                },
            };
            let value: bytes::Bytes = serde_json::to_vec(&next)
                .map_err(|e| QueueError::JetStream(e.to_string()))?
                .into();
            let written = match revision {
                Some(r) => self.records.update(&entry, value, r).await.map(|_| ()),
                None => self
                    .records
                    .create(&entry, value)
                    .await
                    .map(|_| ())
                    .map_err(|e| {
                        kv::UpdateError::new(if e.kind() == kv::CreateErrorKind::AlreadyExists {
                            kv::UpdateErrorKind::WrongLastRevision
                        } else {
                            kv::UpdateErrorKind::Other
                        })
                    }),
            };
            match written {
                Ok(()) => {}
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(js_err("a schedule's window", e)),
            }
            if !next.pending {
                return Ok(Some(Fired::Skipped {
                    window_unix_ms: window,
                    running: next.task.unwrap_or_default(),
                }));
            }
            let task = self.submit_window(s, window, next.task.as_deref()).await?;
            self.settle_window(&entry, window, &task).await?;
            return Ok(Some(Fired::Submitted {
                window_unix_ms: window,
                task,
            }));
        }
        Err(QueueError::Contended(format!("schedule {}", s.name)))
    }

    async fn submit_window(
        &self,
        s: &Schedule,
        window: u64,
        after: Option<&str>,
    ) -> Result<String, QueueError> {
        let mut spec = s.spec.clone();
        spec.schedule = Some((s.name.clone(), window));
        if s.overlap == Overlap::Queue {
            spec.after = after.map(str::to_string);
        }
        let key = format!("schedule/{}/{window}", s.name);
        Ok(self.submit(spec, Some(&key)).await?.task.id)
    }

    async fn settle_window(&self, entry: &str, window: u64, task: &str) -> Result<(), QueueError> {
        for _ in 0..32 {
            let Some(e) = self
                .records
                .entry(entry)
                .await
                .map_err(|e| js_err("a schedule's window", e))?
            else {
                return Ok(());
            };
            let mut state: WindowState = serde_json::from_slice(&e.value)
                .map_err(|e| QueueError::JetStream(e.to_string()))?;
            if state.window_unix_ms != window || !state.pending {
                return Ok(());
            }
            state.pending = false;
            state.task = Some(task.to_string());
            let value =
                serde_json::to_vec(&state).map_err(|e| QueueError::JetStream(e.to_string()))?;
            match self.records.update(entry, value.into(), e.revision).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => return Err(js_err("a schedule's window", e)),
            }
        }
        Ok(())
    }
}

/// The time until `timing`'s next window after `now_ms` (for a worker's sleep).
pub fn until_next(timing: &ScheduleTiming, now_ms: u64) -> Duration {
    match timing {
        ScheduleTiming::Every { ms } => {
            Duration::from_millis(ms - now_ms % ms.max(&1)).min(Duration::from_secs(1))
        }
        ScheduleTiming::Cron { .. } => Duration::from_secs(1),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn windows_start_at_multiples_of_the_period_or_at_cron_times() {
        let hourly = ScheduleTiming::Every { ms: 3_600_000 };
        assert_eq!(hourly.window_at(3_600_000 * 5 + 17).unwrap(), 3_600_000 * 5);
        assert_eq!(hourly.window_at(3_600_000 * 5).unwrap(), 3_600_000 * 5);
        // 2026-12-06T10:17:00Z with "0 * * * *": 10:00.
        let t = chrono::Utc
            .with_ymd_and_hms(2026, 12, 6, 10, 17, 0)
            .unwrap()
            .timestamp_millis() as u64;
        let top = chrono::Utc
            .with_ymd_and_hms(2026, 12, 6, 10, 0, 0)
            .unwrap()
            .timestamp_millis() as u64;
        let cron = ScheduleTiming::Cron {
            expr: "0 * * * *".into(),
        };
        assert_eq!(cron.window_at(t).unwrap(), top);
        assert_eq!(cron.window_at(top).unwrap(), top);
        // Seconds first: every 2 s.
        let fast = ScheduleTiming::Cron {
            expr: "*/2 * * * * *".into(),
        };
        assert_eq!(fast.window_at(t + 3_500).unwrap(), t + 2_000);
        assert!(
            ScheduleTiming::Cron {
                expr: "61 * * * *".into()
            }
            .check()
            .unwrap_err()
            .to_string()
            .contains("cron expression")
        );
        assert!(ScheduleTiming::Every { ms: 10 }.check().is_err());
        assert!("sometimes".parse::<Overlap>().is_err());
        assert!(check_name("nightly-build_2").is_ok());
        assert!(check_name("a.b").is_err());
    }
}
