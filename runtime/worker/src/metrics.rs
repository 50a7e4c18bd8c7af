//! The worker's metrics, in the Prometheus text format at `/metrics` (with `/healthz`) on
//! `--metrics-listen`. Names, labels and help texts are part of the contract (dashboards,
//! alerts, `docs/worker.md`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Tenant {
    tenant: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantOutcome {
    tenant: String,
    outcome: String,
}

/// The worker's counters.
pub struct Metrics {
    registry: Registry,
    depth: Gauge,
    running: Gauge,
    tasks: Family<TenantOutcome, Counter>,
    attempts: Family<Tenant, Counter>,
    cost: Family<Tenant, Counter<f64, std::sync::atomic::AtomicU64>>,
    task_seconds: Family<Tenant, Histogram>,
    wait_seconds: Family<Tenant, Histogram>,
    takeovers: Counter,
    schedule_fires: Counter,
    /// Whether the worker is connected and taking tasks (`/healthz`).
    healthy: AtomicBool,
    lock: Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let depth = Gauge::default();
        let running = Gauge::default();
        let tasks = Family::<TenantOutcome, Counter>::default();
        let attempts = Family::<Tenant, Counter>::default();
        let cost = Family::<Tenant, Counter<f64, std::sync::atomic::AtomicU64>>::default();
        let task_seconds =
            Family::<Tenant, Histogram>::new_with_constructor(histogram as fn() -> Histogram);
        let wait_seconds =
            Family::<Tenant, Histogram>::new_with_constructor(histogram as fn() -> Histogram);
        let takeovers = Counter::default();
        let schedule_fires = Counter::default();
        registry.register(
            "taskbox_queue_depth",
            "Tasks waiting in the work queue, not yet taken by a worker",
            depth.clone(),
        );
        registry.register(
            "taskbox_worker_running",
            "Tasks this worker runs now",
            running.clone(),
        );
        registry.register(
            "taskbox_worker_tasks",
            "Tasks this worker ended, by tenant and outcome (completed, failed, dead, cancelled)",
            tasks.clone(),
        );
        registry.register(
            "taskbox_worker_attempts",
            "Attempts this worker started, by tenant (a takeover of a silent worker's task is one)",
            attempts.clone(),
        );
        registry.register(
            "taskbox_worker_cost_usd",
            "Model cost in US dollars of the tasks this worker ended, by tenant",
            cost.clone(),
        );
        registry.register(
            "taskbox_worker_task_seconds",
            "Seconds from a task's submit to its end, for the tasks this worker ended",
            task_seconds.clone(),
        );
        registry.register(
            "taskbox_worker_queue_wait_seconds",
            "Seconds from a task's submit to the start of its first attempt",
            wait_seconds.clone(),
        );
        registry.register(
            "taskbox_worker_takeovers",
            "Tasks this worker took over from a worker that went silent",
            takeovers.clone(),
        );
        registry.register(
            "taskbox_worker_schedule_fires",
            "Schedule windows whose task this worker submitted",
            schedule_fires.clone(),
        );
        Metrics {
            registry,
            depth,
            running,
            tasks,
            attempts,
            cost,
            task_seconds,
            wait_seconds,
            takeovers,
            schedule_fires,
            healthy: AtomicBool::new(false),
            lock: Mutex::new(()),
        }
    }

    pub fn set_depth(&self, n: u64) {
        self.depth.set(n as i64);
    }

    pub fn started(&self, tenant: &str, takeover: bool, wait_secs: Option<f64>) {
        self.running.inc();
        self.attempts
            .get_or_create(&Tenant {
                tenant: tenant.to_owned(),
            })
            .inc();
        if takeover {
            self.takeovers.inc();
        }
        if let Some(w) = wait_secs {
            self.wait_seconds
                .get_or_create(&Tenant {
                    tenant: tenant.to_owned(),
                })
                .observe(w);
        }
    }

    pub fn stopped(&self) {
        self.running.dec();
    }

    /// A task this worker ended.
    pub fn ended(&self, tenant: &str, outcome: &str, cost_usd: f64, total_secs: Option<f64>) {
        let t = Tenant {
            tenant: tenant.to_owned(),
        };
        self.tasks
            .get_or_create(&TenantOutcome {
                tenant: tenant.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
        if cost_usd > 0.0 {
            self.cost.get_or_create(&t).inc_by(cost_usd);
        }
        if let Some(s) = total_secs {
            self.task_seconds.get_or_create(&t).observe(s);
        }
    }

    pub fn fired(&self) {
        self.schedule_fires.inc();
    }

    pub fn set_healthy(&self, ok: bool) {
        self.healthy.store(ok, Ordering::SeqCst);
    }

    /// The text at `/metrics`.
    pub fn render(&self) -> String {
        let _g = self.lock.lock();
        let mut out = String::new();
        if prometheus_text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `/metrics` and `/healthz` on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    use axum::http::{StatusCode, header};
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let m1 = metrics.clone();
    let m2 = metrics;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = m1.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
                        m.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let m = m2.clone();
                async move {
                    if m.healthy.load(Ordering::SeqCst) {
                        (StatusCode::OK, "ok\n")
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "not connected to the queue\n",
                        )
                    }
                }
            }),
        );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the metrics server stopped");
        }
    });
    Ok(bound)
}
