//! What the objects of one deployment (a kustomization: base plus a worker variant) say of each
//! other: every name one object gives for another must lead to it.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, PodSpec, Probe};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::kube::Object;

/// The flags of `taskbox worker`, read from its `--help`: those that take a value, and those
/// that do not. The binary is the one `scripts/test.sh` builds beside this test (or in
/// `$TASKBOX_BIN_DIR`); `--state-dir` is the CLI's global flag, listed there too.
pub fn worker_flags() -> (BTreeSet<String>, BTreeSet<String>) {
    let bin = match std::env::var_os("TASKBOX_BIN_DIR") {
        Some(d) => std::path::PathBuf::from(d).join("taskbox"),
        None => {
            let exe = std::env::current_exe().unwrap_or_default();
            let deps = exe
                .parent()
                .map(std::path::Path::to_path_buf)
                .unwrap_or_default();
            let dir = if deps.ends_with("deps") {
                deps.parent()
                    .map(std::path::Path::to_path_buf)
                    .unwrap_or_default()
            } else {
                deps
            };
            dir.join("taskbox")
        }
    };
    let out = std::process::Command::new(&bin)
        .args(["worker", "--help"])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} worker --help ({e}): build the binaries first (cargo build --workspace --bins)",
                bin.display()
            )
        });
    assert!(out.status.success(), "taskbox worker --help failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut valued, mut plain) = (BTreeSet::new(), BTreeSet::new());
    for line in text.lines() {
        let line = line.trim_start();
        let line = line.strip_prefix("-h, ").unwrap_or(line);
        if !line.starts_with("--") {
            continue;
        }
        let mut words = line.split_whitespace();
        let flag = words
            .next()
            .unwrap_or_default()
            .trim_end_matches(',')
            .to_owned();
        if words.next().is_some_and(|w| w.starts_with('<')) {
            valued.insert(flag);
        } else {
            plain.insert(flag);
        }
    }
    assert!(
        valued.contains("--nats"),
        "no --nats in taskbox worker --help:\n{text}"
    );
    (valued, plain)
}

/// The variables through which the worker gets its model endpoint; all four must be set.
pub const MODEL_VARIABLES: &[&str] = &[
    "TASKBOX_MODEL_PROVIDER",
    "TASKBOX_MODEL_BASE_URL",
    "TASKBOX_MODEL",
    "TASKBOX_MODEL_API_KEY",
];

/// One object and the file it came from.
#[derive(Debug)]
pub struct Loaded {
    pub file: String,
    pub object: Object,
}

impl Loaded {
    fn at(&self) -> String {
        format!(
            "{}: {} {}",
            self.file,
            self.object.kind(),
            self.object.name()
        )
    }
}

/// A Deployment's or StatefulSet's pods.
struct Workload<'a> {
    owner: &'a Loaded,
    labels: BTreeMap<String, String>,
    spec: &'a PodSpec,
    /// The StatefulSet's volumeClaimTemplates, by name.
    claims: Vec<&'a str>,
    replicas: i32,
}

impl Workload<'_> {
    fn containers(&self) -> impl Iterator<Item = &Container> {
        self.spec
            .init_containers
            .iter()
            .flatten()
            .chain(&self.spec.containers)
    }
}

fn workloads<'a>(objects: &[&'a Loaded]) -> Vec<Workload<'a>> {
    let mut out = Vec::new();
    for l in objects {
        let (template, claims, replicas) = match &l.object {
            Object::Deployment(d) => match &d.spec {
                Some(s) => (&s.template, Vec::new(), s.replicas.unwrap_or(1)),
                None => continue,
            },
            Object::StatefulSet(s) => match &s.spec {
                Some(s) => {
                    let claims = s
                        .volume_claim_templates
                        .iter()
                        .flatten()
                        .filter_map(|c| c.metadata.name.as_deref())
                        .collect();
                    (&s.template, claims, s.replicas.unwrap_or(1))
                }
                None => continue,
            },
            _ => continue,
        };
        let Some(spec) = &template.spec else { continue };
        let labels = template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        out.push(Workload {
            owner: l,
            labels,
            spec,
            claims,
            replicas,
        });
    }
    out
}

/// Whether a non-empty `selector` selects pods labelled `labels`.
fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A label selector's `matchLabels`; `matchExpressions` are not followed by these checks, so
/// they are refused rather than passed unchecked.
fn match_labels<'a>(
    sel: &'a LabelSelector,
    at: &str,
    errors: &mut Vec<String>,
) -> Option<&'a BTreeMap<String, String>> {
    if sel
        .match_expressions
        .as_ref()
        .is_some_and(|e| !e.is_empty())
    {
        errors.push(format!(
            "{at}: matchExpressions in a selector (these checks follow matchLabels only)"
        ));
        return None;
    }
    sel.match_labels.as_ref()
}

fn port_number(c: &Container, name: &str) -> Option<i32> {
    c.ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .map(|p| p.container_port)
}

fn has_port(c: &Container, port: &IntOrString) -> bool {
    match port {
        IntOrString::String(name) => port_number(c, name).is_some(),
        IntOrString::Int(n) => c.ports.iter().flatten().any(|p| p.container_port == *n),
    }
}

/// Everything found wrong with `objects` (one deployment). `templates` are objects the user
/// supplies from a template of docs/deploy (the model key's Secret): references to them count.
pub fn check(objects: &[&Loaded], templates: &[&Loaded]) -> Vec<String> {
    let mut errors = Vec::new();
    let work = workloads(objects);
    namespaces_and_names(objects, &mut errors);
    for w in &work {
        workload(w, objects, templates, &mut errors);
    }
    for l in objects {
        match &l.object {
            Object::Service(s) => {
                let spec = s.spec.clone().unwrap_or_default();
                let selector = spec.selector.clone().unwrap_or_default();
                let chosen: Vec<&Workload> = work
                    .iter()
                    .filter(|w| selects(&selector, &w.labels))
                    .collect();
                if chosen.is_empty() {
                    errors.push(format!("{}: its selector selects no pod", l.at()));
                }
                for port in spec.ports.iter().flatten() {
                    let target = port
                        .target_port
                        .clone()
                        .unwrap_or(IntOrString::Int(port.port));
                    for w in &chosen {
                        if !w.containers().any(|c| has_port(c, &target)) {
                            errors.push(format!(
                                "{}: target port {target:?} is no container port of {}",
                                l.at(),
                                w.owner.at()
                            ));
                        }
                    }
                }
            }
            Object::PodDisruptionBudget(p) => {
                let sel = p.spec.as_ref().and_then(|s| s.selector.as_ref());
                let labels = sel.and_then(|s| match_labels(s, &l.at(), &mut errors));
                if !work
                    .iter()
                    .any(|w| labels.is_some_and(|sel| selects(sel, &w.labels)))
                {
                    errors.push(format!("{}: its selector selects no pod", l.at()));
                }
            }
            Object::NetworkPolicy(n) => network_policy(l, n, &work, &mut errors),
            _ => {}
        }
    }
    nats(objects, &work, &mut errors);
    for w in &work {
        worker(w, objects, &work, &mut errors);
    }
    errors
}

fn namespaces_and_names(objects: &[&Loaded], errors: &mut Vec<String>) {
    let namespaces: Vec<&str> = objects
        .iter()
        .filter(|l| matches!(l.object, Object::Namespace(_)))
        .map(|l| l.object.name())
        .collect();
    if namespaces.len() != 1 {
        errors.push(format!(
            "one Namespace expected in a deployment, found {namespaces:?}"
        ));
    }
    let mut seen = BTreeSet::new();
    for l in objects {
        if let Some(ns) = l.object.namespace()
            && !namespaces.contains(&ns)
        {
            errors.push(format!(
                "{}: in namespace {ns}, which is not defined here",
                l.at()
            ));
        }
        if !seen.insert((l.object.kind(), l.object.namespace(), l.object.name())) {
            errors.push(format!("{}: defined twice", l.at()));
        }
    }
}

/// Whether an object of `kind` named `name` is among `objects` (or the user's `templates`).
fn find<'a>(objects: &[&'a Loaded], kind: &str, name: &str) -> Option<&'a Loaded> {
    objects
        .iter()
        .find(|l| l.object.kind() == kind && l.object.name() == name)
        .copied()
}

/// The keys a ConfigMap or Secret holds.
fn keys(l: &Loaded) -> BTreeSet<String> {
    match &l.object {
        Object::ConfigMap(c) => c
            .data
            .iter()
            .flat_map(|d| d.keys())
            .chain(c.binary_data.iter().flat_map(|d| d.keys()))
            .cloned()
            .collect(),
        Object::Secret(s) => s
            .string_data
            .iter()
            .flat_map(|d| d.keys())
            .chain(s.data.iter().flat_map(|d| d.keys()))
            .cloned()
            .collect(),
        _ => BTreeSet::new(),
    }
}

fn workload(w: &Workload, objects: &[&Loaded], templates: &[&Loaded], errors: &mut Vec<String>) {
    let at = w.owner.at();
    // The workload's own selector must select its pods.
    let selector = match &w.owner.object {
        Object::Deployment(d) => d.spec.as_ref().map(|s| &s.selector),
        Object::StatefulSet(s) => s.spec.as_ref().map(|s| &s.selector),
        _ => None,
    };
    if let Some(sel) = selector.and_then(|s| match_labels(s, &at, errors))
        && !selects(sel, &w.labels)
    {
        errors.push(format!("{at}: spec.selector does not select its own pods"));
    }
    let referent = |kind: &str, name: &str, what: &str, errors: &mut Vec<String>| {
        let found = find(objects, kind, name).or_else(|| find(templates, kind, name));
        if found.is_none() {
            errors.push(format!(
                "{at}: {what} names {kind} {name}, which is not defined"
            ));
        }
        found
    };
    match w.spec.service_account_name.as_deref() {
        None | Some("default") => {}
        Some(sa) => {
            referent("ServiceAccount", sa, "serviceAccountName", errors);
        }
    }
    let mut volumes = BTreeSet::new();
    for v in w.spec.volumes.iter().flatten() {
        if !volumes.insert(v.name.as_str()) {
            errors.push(format!("{at}: volume {} twice", v.name));
        }
        if let Some(cm) = &v.config_map {
            let found = referent("ConfigMap", &cm.name, "a volume", errors);
            if let (Some(found), Some(items)) = (found, &cm.items) {
                let have = keys(found);
                for item in items.iter().filter(|i| !have.contains(&i.key)) {
                    errors.push(format!(
                        "{at}: volume {} wants key {}, not in it",
                        v.name, item.key
                    ));
                }
            }
            if cm.default_mode.is_some_and(|m| !(0..=0o777).contains(&m)) {
                errors.push(format!("{at}: volume {}: defaultMode above 0777", v.name));
            }
        }
        if let Some(s) = &v.secret
            && let Some(name) = &s.secret_name
        {
            referent("Secret", name, "a volume", errors);
        }
        if let Some(pvc) = &v.persistent_volume_claim {
            referent("PersistentVolumeClaim", &pvc.claim_name, "a volume", errors);
        }
        if let Some(q) = v.empty_dir.as_ref().and_then(|e| e.size_limit.as_ref())
            && !quantity(&q.0)
        {
            errors.push(format!(
                "{at}: volume {}: sizeLimit {:?} is no quantity",
                v.name, q.0
            ));
        }
    }
    for claim in &w.claims {
        if !volumes.insert(claim) {
            errors.push(format!(
                "{at}: volume {claim} twice (a volume and a claim template)"
            ));
        }
    }
    let names: Vec<&str> = w.containers().map(|c| c.name.as_str()).collect();
    for c in w.containers() {
        let at = format!("{at}, container {}", c.name);
        let mut paths = BTreeSet::new();
        for m in c.volume_mounts.iter().flatten() {
            if !volumes.contains(m.name.as_str()) {
                errors.push(format!(
                    "{at}: mounts volume {}, which the pod does not have",
                    m.name
                ));
            }
            if !paths.insert(m.mount_path.as_str()) {
                errors.push(format!("{at}: two mounts on {}", m.mount_path));
            }
        }
        let mut port_names = BTreeSet::new();
        for p in c.ports.iter().flatten() {
            if let Some(name) = &p.name {
                let ok = !name.is_empty()
                    && name.len() <= 15
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && name.bytes().any(|b| b.is_ascii_lowercase());
                if !ok {
                    errors.push(format!(
                        "{at}: port name {name:?} is not a valid IANA service name"
                    ));
                }
                if !port_names.insert(name.as_str()) {
                    errors.push(format!("{at}: port name {name} twice"));
                }
            }
        }
        for (which, probe) in [
            ("livenessProbe", &c.liveness_probe),
            ("readinessProbe", &c.readiness_probe),
            ("startupProbe", &c.startup_probe),
        ] {
            if let Some(port) = probe.as_ref().and_then(probe_port)
                && !has_port(c, &port)
            {
                errors.push(format!(
                    "{at}: {which} uses port {port:?}, which the container does not have"
                ));
            }
        }
        for e in c.env.iter().flatten() {
            let Some(from) = &e.value_from else { continue };
            if let Some(r) = &from.config_map_key_ref {
                key_ref(
                    "ConfigMap",
                    &r.name,
                    &r.key,
                    r.optional,
                    &e.name,
                    &at,
                    objects,
                    templates,
                    errors,
                );
            }
            if let Some(r) = &from.secret_key_ref {
                key_ref(
                    "Secret", &r.name, &r.key, r.optional, &e.name, &at, objects, templates, errors,
                );
            }
            if let Some(r) = &from.resource_field_ref
                && r.container_name
                    .as_deref()
                    .is_some_and(|n| !names.contains(&n))
            {
                errors.push(format!(
                    "{at}: {} refers to a container that is not in the pod",
                    e.name
                ));
            }
        }
        for e in c.env_from.iter().flatten() {
            if let Some(r) = &e.config_map_ref {
                referent("ConfigMap", &r.name, "envFrom", errors);
            }
            if let Some(r) = &e.secret_ref {
                referent("Secret", &r.name, "envFrom", errors);
            }
        }
        if let Some(res) = &c.resources {
            for (k, q) in res
                .limits
                .iter()
                .flatten()
                .chain(res.requests.iter().flatten())
            {
                if !quantity(&q.0) {
                    errors.push(format!("{at}: resource {k}: {:?} is no quantity", q.0));
                }
            }
        }
        if !c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_some_and(|l| l.contains_key("memory"))
        {
            errors.push(format!("{at}: no memory limit"));
        }
        if let Some(sc) = &c.security_context {
            let sys_admin = sc
                .capabilities
                .as_ref()
                .and_then(|c| c.add.as_ref())
                .is_some_and(|add| add.iter().any(|a| a == "SYS_ADMIN" || a == "CAP_SYS_ADMIN"));
            if sc.allow_privilege_escalation == Some(false)
                && (sys_admin || sc.privileged == Some(true))
            {
                errors.push(format!(
                    "{at}: allowPrivilegeEscalation false with SYS_ADMIN or privileged, which the \
                     API server refuses"
                ));
            }
        }
    }
}

#[allow(clippy::too_many_arguments)] // one reference, told in full
fn key_ref(
    kind: &str,
    name: &str,
    key: &str,
    optional: Option<bool>,
    var: &str,
    at: &str,
    objects: &[&Loaded],
    templates: &[&Loaded],
    errors: &mut Vec<String>,
) {
    if optional == Some(true) {
        return;
    }
    match find(objects, kind, name).or_else(|| find(templates, kind, name)) {
        None => errors.push(format!(
            "{at}: {var} comes from {kind} {name}, which is not defined"
        )),
        Some(found) if !keys(found).contains(key) => errors.push(format!(
            "{at}: {var} comes from key {key} of {kind} {name}, which it has not"
        )),
        Some(_) => {}
    }
}

fn probe_port(p: &Probe) -> Option<IntOrString> {
    if let Some(h) = &p.http_get {
        return Some(h.port.clone());
    }
    if let Some(t) = &p.tcp_socket {
        return Some(t.port.clone());
    }
    p.grpc.as_ref().map(|g| IntOrString::Int(g.port))
}

/// Whether `s` is a Kubernetes quantity: a decimal number and a suffix (Ki..Ei, m, k..E, or an
/// exponent).
pub fn quantity(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let number_ok = !number.is_empty() && number != "." && number.matches('.').count() <= 1;
    let suffix_ok = matches!(
        suffix,
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "m" | "k" | "M" | "G" | "T" | "P" | "E"
    ) || suffix
        .strip_prefix(['e', 'E'])
        .map(|e| e.strip_prefix(['+', '-']).unwrap_or(e))
        .is_some_and(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()));
    number_ok && suffix_ok
}

fn network_policy(
    l: &Loaded,
    n: &k8s_openapi::api::networking::v1::NetworkPolicy,
    work: &[Workload],
    errors: &mut Vec<String>,
) {
    let at = l.at();
    let Some(spec) = &n.spec else { return };
    let Some(own) = spec
        .pod_selector
        .as_ref()
        .and_then(|s| match_labels(s, &at, errors))
    else {
        errors.push(format!(
            "{at}: an empty podSelector (every pod): name the pods"
        ));
        return;
    };
    let targets: Vec<&Workload> = work.iter().filter(|w| selects(own, &w.labels)).collect();
    if targets.is_empty() {
        errors.push(format!("{at}: its podSelector selects no pod"));
    }
    for rule in spec.ingress.iter().flatten() {
        for peer in rule.from.iter().flatten() {
            if let Some(sel) = &peer.pod_selector
                && let Some(sel) = match_labels(sel, &at, errors)
                && !work.iter().any(|w| selects(sel, &w.labels))
            {
                errors.push(format!("{at}: a from podSelector selects no pod here"));
            }
        }
        for port in rule.ports.iter().flatten().filter_map(|p| p.port.as_ref()) {
            for w in &targets {
                if !w.containers().any(|c| has_port(c, port)) {
                    errors.push(format!(
                        "{at}: port {port:?} is no container port of {}",
                        w.owner.at()
                    ));
                }
            }
        }
    }
}

/// The parts of nats-server's configuration these checks compare with the manifests. The file
/// itself is checked by nats-server (`nats_config_is_valid_for_nats_server` in main.rs).
#[derive(Debug, Default)]
pub struct NatsConf {
    pub port: Option<i32>,
    pub http_port: Option<i32>,
    pub cluster_port: Option<i32>,
    pub store_dir: Option<String>,
    pub routes: Vec<String>,
    /// `$NAME` references to the environment.
    pub variables: BTreeSet<String>,
}

pub fn nats_conf(text: &str) -> NatsConf {
    let mut conf = NatsConf::default();
    let mut blocks: Vec<String> = Vec::new();
    let mut in_routes = false;
    for raw in text.lines() {
        let line = raw.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        if in_routes {
            if line.starts_with(']') {
                in_routes = false;
            } else {
                conf.routes
                    .push(line.trim_matches(|c| c == '"' || c == ',').to_owned());
            }
            continue;
        }
        if line == "}" {
            blocks.pop();
            continue;
        }
        let (key, value) = match line.split_once([':', '=', ' ']) {
            Some((k, v)) => (k.trim(), v.trim()),
            None => (line, ""),
        };
        if value == "{" || value.ends_with('{') {
            blocks.push(key.to_owned());
            continue;
        }
        for word in value.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$')) {
            if let Some(var) = word.strip_prefix('$') {
                conf.variables.insert(var.to_owned());
            }
        }
        let value = value.trim_matches('"');
        let block = blocks.last().map(String::as_str);
        match (block, key) {
            (None, "port") => conf.port = value.parse().ok(),
            (None, "http_port") => conf.http_port = value.parse().ok(),
            (Some("cluster"), "port") => conf.cluster_port = value.parse().ok(),
            (Some("cluster"), "routes") if value.starts_with('[') => in_routes = true,
            (Some("jetstream"), "store_dir") => conf.store_dir = Some(value.to_owned()),
            _ => {}
        }
    }
    conf
}

/// Whether `host` is `service`, in the namespace `ns`, by one of the names a pod may use.
fn names_service(host: &str, service: &str, ns: &str) -> bool {
    let Some(rest) = host.strip_prefix(service) else {
        return false;
    };
    [
        String::new(),
        format!(".{ns}"),
        format!(".{ns}.svc"),
        format!(".{ns}.svc.cluster.local"),
    ]
    .contains(&rest.to_owned())
}

fn nats(objects: &[&Loaded], work: &[Workload], errors: &mut Vec<String>) {
    for w in work {
        let Object::StatefulSet(sts) = &w.owner.object else {
            continue;
        };
        let at = w.owner.at();
        // The configuration: a ConfigMap volume with a key nats.conf.
        let mut conf = None;
        let mut conf_mount = None;
        for v in w.spec.volumes.iter().flatten() {
            let Some(cm) = &v.config_map else { continue };
            let Some(Object::ConfigMap(found)) =
                find(objects, "ConfigMap", &cm.name).map(|l| &l.object)
            else {
                continue;
            };
            if let Some(text) = found.data.as_ref().and_then(|d| d.get("nats.conf")) {
                conf = Some(nats_conf(text));
                conf_mount = Some(v.name.clone());
            }
        }
        let (Some(conf), Some(conf_volume)) = (conf, conf_mount) else {
            continue;
        };
        let Some(nats) = w.spec.containers.iter().find(|c| {
            c.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == conf_volume)
        }) else {
            errors.push(format!("{at}: no container mounts the nats.conf volume"));
            continue;
        };
        let conf_path = nats
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == conf_volume)
            .map(|m| format!("{}/nats.conf", m.mount_path));
        let args = nats.args.clone().unwrap_or_default();
        if !args
            .windows(2)
            .any(|a| a[0] == "--config" && Some(&a[1]) == conf_path.as_ref())
        {
            errors.push(format!(
                "{at}: nats-server is not started with --config {conf_path:?}"
            ));
        }
        for (name, port) in [
            ("client", conf.port),
            ("cluster", conf.cluster_port),
            ("monitor", conf.http_port),
        ] {
            if port.is_none() || port_number(nats, name) != port {
                errors.push(format!(
                    "{at}: container port {name} is {:?}, nats.conf says {port:?}",
                    port_number(nats, name)
                ));
            }
        }
        let env: BTreeSet<&str> = nats.env.iter().flatten().map(|e| e.name.as_str()).collect();
        for var in conf.variables.iter().filter(|v| !env.contains(v.as_str())) {
            errors.push(format!(
                "{at}: nats.conf uses ${var}, which the container's env lacks"
            ));
        }
        let store = nats
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| w.claims.contains(&m.name.as_str()))
            .map(|m| m.mount_path.clone());
        if store.is_none() || store != conf.store_dir {
            errors.push(format!(
                "{at}: JetStream's store_dir {:?} is not the claim template's mount {store:?}",
                conf.store_dir
            ));
        }
        // The routes: each pod of the set by its name under the headless Service.
        let spec = sts.spec.as_ref();
        let service = spec
            .and_then(|s| s.service_name.as_deref())
            .unwrap_or_default();
        let ns = w.owner.object.namespace().unwrap_or_default();
        match find(objects, "Service", service).map(|l| &l.object) {
            Some(Object::Service(s)) => {
                let spec = s.spec.clone().unwrap_or_default();
                if spec.cluster_ip.as_deref() != Some("None") {
                    errors.push(format!("{at}: serviceName {service} is not headless"));
                }
                if !selects(&spec.selector.unwrap_or_default(), &w.labels) {
                    errors.push(format!(
                        "{at}: serviceName {service} does not select its pods"
                    ));
                }
                if spec.publish_not_ready_addresses != Some(true) {
                    errors.push(format!(
                        "{at}: serviceName {service} does not publish not-ready pods, which the \
                         routes need before the servers are ready"
                    ));
                }
            }
            _ => errors.push(format!("{at}: serviceName {service:?} is no Service here")),
        }
        let sts_name = w.owner.object.name();
        let mut expected: BTreeSet<i32> = (0..w.replicas).collect();
        for route in &conf.routes {
            let ok = route
                .strip_prefix("nats://")
                .and_then(|r| r.rsplit_once(':'))
                .and_then(|(host, port)| {
                    let (pod, rest) = host.split_once('.')?;
                    let ordinal: i32 = pod
                        .strip_prefix(sts_name)?
                        .strip_prefix('-')?
                        .parse()
                        .ok()?;
                    (names_service(rest, service, ns) && port.parse().ok() == conf.cluster_port)
                        .then_some(ordinal)
                });
            match ok {
                Some(i) if expected.remove(&i) => {}
                _ => errors.push(format!(
                    "{at}: route {route} is not nats://{sts_name}-N.{service}:{:?} for a pod N \
                     of the set (or names one twice)",
                    conf.cluster_port
                )),
            }
        }
        if !expected.is_empty() {
            errors.push(format!("{at}: no route to the pods {expected:?}"));
        }
    }
}

fn worker(w: &Workload, objects: &[&Loaded], work: &[Workload], errors: &mut Vec<String>) {
    for c in &w.spec.containers {
        let Some(args) = c.args.as_deref() else {
            continue;
        };
        if args.first().map(String::as_str) != Some("worker") {
            continue;
        }
        let at = format!("{}, container {}", w.owner.at(), c.name);
        let (valued, plain) = worker_flags();
        let mut flags: BTreeMap<&str, &str> = BTreeMap::new();
        let mut rest = args[1..].iter();
        while let Some(arg) = rest.next() {
            let Some(flag) = arg.strip_prefix("--").map(|_| arg.as_str()) else {
                errors.push(format!("{at}: argument {arg:?} where a flag was expected"));
                continue;
            };
            if plain.contains(flag) {
                continue;
            }
            let (flag, value) = match flag.split_once('=') {
                Some((f, v)) => (f, Some(v)),
                None => (flag, rest.next().map(String::as_str)),
            };
            if !valued.contains(flag) {
                errors.push(format!("{at}: {flag} is not a flag of taskbox worker"));
            }
            match value {
                Some(v) if !v.starts_with("--") => {
                    if flags.insert(flag, v).is_some() {
                        errors.push(format!("{at}: {flag} twice"));
                    }
                }
                _ => errors.push(format!("{at}: {flag} without its value")),
            }
        }
        if w.spec.enable_service_links != Some(false) {
            errors.push(format!(
                "{at}: enableServiceLinks is not false (Services would set TASKBOX_* variables)"
            ));
        }
        let env: BTreeSet<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
        for var in MODEL_VARIABLES.iter().filter(|v| !env.contains(*v)) {
            errors.push(format!("{at}: {var} is not set"));
        }
        match flags.get("--backend") {
            Some(&"native" | &"docker") => {}
            other => errors.push(format!(
                "{at}: --backend is {other:?}, not native or docker"
            )),
        }
        let mounts: Vec<&str> = c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        match flags.get("--state-dir") {
            Some(dir) if mounts.contains(dir) => {}
            other => errors.push(format!(
                "{at}: --state-dir {other:?} is no volume mount of the container"
            )),
        }
        let metrics_port = flags
            .get("--metrics-listen")
            .and_then(|l| l.rsplit_once(':'))
            .and_then(|(_, p)| p.parse::<i32>().ok());
        if metrics_port.is_none() || metrics_port != port_number(c, "metrics") {
            errors.push(format!(
                "{at}: --metrics-listen's port {metrics_port:?} is not the container port metrics"
            ));
        }
        // The queue: the client Service of the NATS StatefulSet.
        let nats_sets: Vec<&Workload> = work
            .iter()
            .filter(|n| matches!(n.owner.object, Object::StatefulSet(_)))
            .collect();
        let ns = w.owner.object.namespace().unwrap_or_default();
        let Some(urls) = flags.get("--nats") else {
            errors.push(format!("{at}: no --nats"));
            continue;
        };
        for url in urls.split(',') {
            let target = url
                .strip_prefix("nats://")
                .map(|r| r.rsplit_once('@').map_or(r, |(_, h)| h))
                .and_then(|r| r.rsplit_once(':'));
            let Some((host, port)) = target else {
                errors.push(format!("{at}: --nats {url} is not nats://HOST:PORT"));
                continue;
            };
            let service = objects.iter().find_map(|l| match &l.object {
                Object::Service(s) if names_service(host, l.object.name(), ns) => Some(s),
                _ => None,
            });
            let Some(spec) = service.and_then(|s| s.spec.clone()) else {
                errors.push(format!("{at}: --nats host {host} is no Service here"));
                continue;
            };
            if spec.cluster_ip.as_deref() == Some("None") {
                errors.push(format!(
                    "{at}: --nats names the headless Service {host}: use the client Service"
                ));
            }
            let selector = spec.selector.unwrap_or_default();
            if !nats_sets.iter().any(|n| selects(&selector, &n.labels)) {
                errors.push(format!(
                    "{at}: --nats Service {host} does not select the NATS servers"
                ));
            }
            if !spec
                .ports
                .iter()
                .flatten()
                .any(|p| Some(p.port) == port.parse().ok())
            {
                errors.push(format!(
                    "{at}: --nats port {port} is no port of Service {host}"
                ));
            }
        }
        if let Some(r) = flags.get("--replicas").and_then(|r| r.parse::<i32>().ok())
            && !nats_sets.iter().any(|n| n.replicas >= r)
        {
            errors.push(format!(
                "{at}: --replicas {r} is more than the NATS servers"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{names_service, nats_conf, quantity};

    #[test]
    fn quantities_are_recognised() {
        for ok in [
            "1", "250m", "1.5", "1Gi", "512Mi", "9G", "1e3", "2E-2", "0.5Ki",
        ] {
            assert!(quantity(ok), "{ok}");
        }
        for bad in ["", "1GB", "1 Gi", "Gi", "1.2.3", "1gi", ".", "1e"] {
            assert!(!quantity(bad), "{bad}");
        }
    }

    #[test]
    fn the_nats_configuration_is_read_for_the_checks() {
        let conf = nats_conf(
            "server_name: $POD_NAME # a comment\nport: 4222\nhttp_port: 8222\n\
             jetstream {\n  store_dir: \"/data\"\n}\ncluster {\n  port: 6222\n  routes: [\n    \
             \"nats://a-0.h:6222\"\n    nats://a-1.h:6222\n  ]\n}\n",
        );
        assert_eq!(
            (conf.port, conf.http_port, conf.cluster_port),
            (Some(4222), Some(8222), Some(6222))
        );
        assert_eq!(conf.store_dir.as_deref(), Some("/data"));
        assert_eq!(conf.routes, ["nats://a-0.h:6222", "nats://a-1.h:6222"]);
        assert!(conf.variables.contains("POD_NAME"));
        assert!(names_service("svc.ns.svc", "svc", "ns"));
        assert!(!names_service("svc2", "svc", "ns"));
        assert!(!names_service("svc.other", "svc", "ns"));
    }
}
