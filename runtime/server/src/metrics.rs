//! The server's metrics, exposed by `prometheus-client` in the Prometheus text format (0.0.4).
//!
//! Names, labels and help texts are part of the contract (dashboards, alerts, docs): counters are
//! registered without their `_total`, which the encoder adds, and help texts without their final
//! `.`, which the registry adds.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use taskbox_core::api::ExecOutcome;

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Upper bounds (seconds) of the exec duration histogram's buckets; `+Inf` follows.
pub const EXEC_BUCKETS: [f64; 13] = [
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabel {
    limit: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabel {
    operation: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SecretUseLabels {
    sandbox: String,
    secret: String,
    host: String,
}

/// The server's counters, and the registry that writes them out.
#[derive(Debug)]
pub struct Metrics {
    /// The registry, locked while the live-sandbox gauges are set and the text is written, so
    /// that two scrapes at once do not interleave their gauges.
    registry: Mutex<Registry>,
    sandboxes_live: Family<TenantLabel, Gauge>,
    sandboxes_starting: Family<TenantLabel, Gauge>,
    fork_pool: Gauge,
    fork_pool_ready: Gauge,
    fork_pool_served: Gauge,
    creates_refused: Family<LimitLabel, Counter>,
    execs: Counter,
    exec_duration: Histogram,
    http: Family<RouteLabels, Counter>,
    violations: Family<KindLabel, Counter>,
    errors: Family<CodeLabel, Counter>,
    idempotent_replays: Family<OperationLabel, Counter>,
    connections_open: Gauge,
    connections_accepted: Counter,
    connections_refused: Family<ReasonLabel, Counter>,
    connections_timed_out: Family<ReasonLabel, Counter>,
    secret_uses: Family<SecretUseLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let m = Metrics {
            registry: Mutex::new(Registry::default()),
            sandboxes_live: Family::default(),
            sandboxes_starting: Family::default(),
            fork_pool: Gauge::default(),
            fork_pool_ready: Gauge::default(),
            fork_pool_served: Gauge::default(),
            creates_refused: Family::default(),
            execs: Counter::default(),
            exec_duration: Histogram::new(EXEC_BUCKETS),
            http: Family::default(),
            violations: Family::default(),
            errors: Family::default(),
            idempotent_replays: Family::default(),
            connections_open: Gauge::default(),
            connections_accepted: Counter::default(),
            connections_refused: Family::default(),
            connections_timed_out: Family::default(),
            secret_uses: Family::default(),
        };
        if let Ok(mut r) = m.registry.lock() {
            r.register(
                "taskbox_sandboxes_live",
                "Live sandboxes per tenant",
                m.sandboxes_live.clone(),
            );
            r.register(
                "taskbox_sandboxes_starting",
                "Sandboxes being created or forked per tenant",
                m.sandboxes_starting.clone(),
            );
            r.register(
                "taskbox_fork_pool_sandboxes",
                "Sandboxes the warm pool of forks holds (counted in the total, no tenant's)",
                m.fork_pool.clone(),
            );
            r.register(
                "taskbox_fork_pool_ready",
                "Sandboxes of the warm pool of forks started and ready (the rest are starting)",
                m.fork_pool_ready.clone(),
            );
            r.register(
                "taskbox_fork_pool_served",
                "Forks served from the warm pool since the start (a count)",
                m.fork_pool_served.clone(),
            );
            r.register(
                "taskbox_creates_refused",
                "Creates and forks refused by a limit, by limit",
                m.creates_refused.clone(),
            );
            r.register(
                "taskbox_execs",
                "Exec requests completed (background execs count when started)",
                m.execs.clone(),
            );
            r.register(
                "taskbox_exec_duration_seconds",
                "Wall-clock duration of exec requests",
                m.exec_duration.clone(),
            );
            r.register(
                "taskbox_http_requests",
                "HTTP requests by route template and status",
                m.http.clone(),
            );
            r.register(
                "taskbox_violations",
                "Policy violations reported by execs, by kind",
                m.violations.clone(),
            );
            r.register(
                "taskbox_connections_open",
                "Open API connections",
                m.connections_open.clone(),
            );
            r.register(
                "taskbox_connections_accepted",
                "API connections let in",
                m.connections_accepted.clone(),
            );
            r.register(
                "taskbox_connections_refused",
                "API connections turned away before a request was served, by reason",
                m.connections_refused.clone(),
            );
            r.register(
                "taskbox_connections_timed_out",
                "API connections closed by a timeout, by timeout",
                m.connections_timed_out.clone(),
            );
            r.register(
                "taskbox_errors",
                "Error answers by error code",
                m.errors.clone(),
            );
            r.register(
                "taskbox_egress_secret_uses",
                "Requests on which the egress proxy presented a secret, by sandbox, secret name \
                 and host (never the value)",
                m.secret_uses.clone(),
            );
            r.register(
                "taskbox_idempotent_replays",
                "Answers given again to a request with an idempotency key, by operation",
                m.idempotent_replays.clone(),
            );
        }
        m
    }
}

impl Metrics {
    /// Records one finished exec (or a background exec's start) and its violations.
    pub fn exec(&self, took: Duration, outcome: Option<&ExecOutcome>) {
        self.execs.inc();
        self.exec_duration.observe(took.as_secs_f64());
        if let Some(ExecOutcome::Finished(r)) = outcome {
            for v in &r.violations {
                self.violations
                    .get_or_create(&KindLabel {
                        kind: v.kind.clone(),
                    })
                    .inc();
            }
        }
    }

    pub fn http(&self, route: &str, status: u16) {
        self.http
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
                status,
            })
            .inc();
    }

    pub fn error(&self, code: &str) {
        self.errors
            .get_or_create(&CodeLabel {
                code: code.to_owned(),
            })
            .inc();
    }

    /// A request with an idempotency key got the answer of an earlier (or a running) one.
    pub fn idempotent_replay(&self, operation: &str) {
        self.idempotent_replays
            .get_or_create(&OperationLabel {
                operation: operation.to_owned(),
            })
            .inc();
    }

    /// A connection was let in (`open` is how many are open now).
    pub fn connection_opened(&self, open: usize) {
        self.connections_accepted.inc();
        self.connections_open.set(gauge_value(open));
    }

    /// A connection ended (`open` is how many are still open).
    pub fn connection_ended(&self, open: usize) {
        self.connections_open.set(gauge_value(open));
    }

    /// A connection was turned away before any request was served: `sandboxed_peer`,
    /// `uninspectable_peer`, `max_connections`, `max_connections_per_client`.
    pub fn connection_refused(&self, reason: &str) {
        self.connections_refused
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// A connection was closed by a timeout: `header_timeout`, `idle_timeout`, `write_timeout`.
    pub fn connection_timed_out(&self, reason: &str) {
        self.connections_timed_out
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// A create (or fork) was refused by `limit`.
    pub fn create_refused(&self, limit: &str) {
        self.creates_refused
            .get_or_create(&LimitLabel {
                limit: limit.to_owned(),
            })
            .inc();
    }

    /// Sets the number of sandboxes the warm pool of forks holds (`n`, of which `ready` are
    /// started) and has served, before a render.
    pub fn set_pooled(&self, n: usize, ready: usize, served: u64) {
        self.fork_pool.set(gauge_value(n));
        self.fork_pool_ready.set(gauge_value(ready));
        self.fork_pool_served
            .set(i64::try_from(served).unwrap_or(i64::MAX));
    }

    /// The exposition text ([`CONTENT_TYPE`]); `live` is the number of live sandboxes per
    /// tenant, `starting` of those being created.
    pub fn render(
        &self,
        live: &BTreeMap<String, usize>,
        starting: &BTreeMap<String, usize>,
    ) -> String {
        let mut out = String::new();
        let Ok(registry) = self.registry.lock() else {
            return out;
        };
        // The live count is a snapshot of the table, not an event: tenants without sandboxes
        // leave the family.
        self.sandboxes_live.clear();
        for (tenant, n) in live {
            self.sandboxes_live
                .get_or_create(&TenantLabel {
                    tenant: tenant.clone(),
                })
                .set(gauge_value(*n));
        }
        // The proxies count every use of a secret as it happens (taskbox_egress::audit); the
        // counters catch up with them here.
        for u in taskbox_egress::audit::secret_uses() {
            let counter = self.secret_uses.get_or_create(&SecretUseLabels {
                sandbox: u.sandbox,
                secret: u.secret,
                host: u.host,
            });
            let seen = counter.get();
            if u.uses > seen {
                counter.inc_by(u.uses - seen);
            }
        }
        self.sandboxes_starting.clear();
        for (tenant, n) in starting {
            self.sandboxes_starting
                .get_or_create(&TenantLabel {
                    tenant: tenant.clone(),
                })
                .set(gauge_value(*n));
        }
        // Writing to a String cannot fail.
        let _ = prometheus_text::encode(&mut out, &registry);
        out
    }
}

fn gauge_value(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_labels_are_escaped() {
        let m = Metrics::default();
        m.exec(Duration::from_millis(3), None);
        m.exec(Duration::from_secs(2), None);
        m.exec(Duration::from_secs(5000), None);
        m.error("a\"b");
        let mut live = BTreeMap::new();
        live.insert("alice".to_string(), 2);
        let text = m.render(&live, &BTreeMap::from([("bob".to_string(), 3)]));
        assert!(text.contains("taskbox_sandboxes_live{tenant=\"alice\"} 2\n"));
        assert!(text.contains("taskbox_sandboxes_starting{tenant=\"bob\"} 3\n"));
        assert!(text.contains("taskbox_exec_duration_seconds_bucket{le=\"0.01\"} 1\n"));
        assert!(text.contains("taskbox_exec_duration_seconds_bucket{le=\"2.5\"} 2\n"));
        assert!(text.contains("taskbox_exec_duration_seconds_bucket{le=\"900\"} 2\n"));
        assert!(text.contains("taskbox_exec_duration_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("taskbox_exec_duration_seconds_count 3\n"));
        assert!(text.contains("taskbox_errors_total{code=\"a\\\"b\"} 1\n"));
    }

    #[test]
    fn names_types_and_help_texts_are_those_of_the_contract() {
        let m = Metrics::default();
        m.http("/v1/sandboxes", 201);
        m.connection_opened(1);
        m.connection_refused("sandboxed_peer");
        m.connection_timed_out("header_timeout");
        m.error("unauthorized");
        m.idempotent_replay("create_sandbox");
        let mut live = BTreeMap::new();
        live.insert("alice".to_string(), 1);
        m.create_refused("max_starting_total");
        m.render(&live, &BTreeMap::new());
        live.clear();
        live.insert("bob".to_string(), 1);
        let text = m.render(&live, &BTreeMap::from([("bob".to_string(), 1)]));
        for (name, kind, help) in [
            (
                "taskbox_sandboxes_live",
                "gauge",
                "Live sandboxes per tenant.",
            ),
            (
                "taskbox_sandboxes_starting",
                "gauge",
                "Sandboxes being created or forked per tenant.",
            ),
            (
                "taskbox_creates_refused_total",
                "counter",
                "Creates and forks refused by a limit, by limit.",
            ),
            (
                "taskbox_execs_total",
                "counter",
                "Exec requests completed (background execs count when started).",
            ),
            (
                "taskbox_exec_duration_seconds",
                "histogram",
                "Wall-clock duration of exec requests.",
            ),
            (
                "taskbox_http_requests_total",
                "counter",
                "HTTP requests by route template and status.",
            ),
            ("taskbox_connections_open", "gauge", "Open API connections."),
            (
                "taskbox_connections_accepted_total",
                "counter",
                "API connections let in.",
            ),
            (
                "taskbox_connections_refused_total",
                "counter",
                "API connections turned away before a request was served, by reason.",
            ),
            (
                "taskbox_connections_timed_out_total",
                "counter",
                "API connections closed by a timeout, by timeout.",
            ),
            (
                "taskbox_errors_total",
                "counter",
                "Error answers by error code.",
            ),
            (
                "taskbox_idempotent_replays_total",
                "counter",
                "Answers given again to a request with an idempotency key, by operation.",
            ),
        ] {
            assert!(
                text.contains(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n")),
                "{name}: {text}"
            );
        }
        assert!(text.contains("taskbox_execs_total 0\n"), "{text}");
        assert!(text.contains("taskbox_connections_open 1\n"), "{text}");
        assert!(
            text.contains(
                "taskbox_http_requests_total{route=\"/v1/sandboxes\",status=\"201\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("taskbox_connections_refused_total{reason=\"sandboxed_peer\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("taskbox_connections_timed_out_total{reason=\"header_timeout\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("taskbox_idempotent_replays_total{operation=\"create_sandbox\"} 1\n"),
            "{text}"
        );
        // A tenant whose sandboxes are gone leaves the gauge.
        assert!(!text.contains("tenant=\"alice\""), "{text}");
        assert!(
            text.contains("taskbox_sandboxes_live{tenant=\"bob\"} 1\n"),
            "{text}"
        );
        // A family without series writes nothing yet (as the Go client does).
        assert!(!text.contains("taskbox_violations_total"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
    }
}
