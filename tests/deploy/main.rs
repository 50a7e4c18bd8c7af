//! The Kubernetes manifests in `docs/deploy`, checked without a cluster:
//!
//! - every document of every YAML file is read strictly (`yaml.rs`: what YAML 1.1 and 1.2 read
//!   differently must be quoted; no duplicate keys, anchors or tags) and as the Kubernetes API
//!   object its `apiVersion` and `kind` name, in the `k8s-openapi` types of the oldest
//!   Kubernetes the manifests support (feature `v1_33`); an unknown kind, a misspelled or
//!   misplaced field fails (`kube.rs`);
//! - each deployment (a top-level `kustomization.yaml`: `native/`, `docker/`) is checked as a
//!   whole (`refs.rs`): selectors select pods, what a pod names exists, probes use the
//!   container's ports, the NATS routes name the StatefulSet's pods, the worker's `--nats` is the
//!   client Service and its flags are `taskbox worker`'s;
//! - every file belongs to a deployment, or is a template the user fills in (`*.example.yaml`,
//!   named in `docs/deploy/README.md`);
//! - nats-server itself reads the NATS configuration, and `sh -n` the entrypoint script.
//!
//! The negative tests at the end break the real manifests one way each and check that the
//! breakage is named.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

mod kube;
mod refs;
mod yaml;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use kube::Object;
use refs::Loaded;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/deploy")
}

/// The tests' prerequisite `ok`, or a skip that says why; a failure under
/// `TASKBOX_REQUIRE_ALL=1`, as everywhere in taskbox's suites (`taskbox_tests::require`, not
/// linked here to keep this crate off the runtime's build).
fn require(ok: bool, reason: &str) -> bool {
    if !ok {
        assert!(
            std::env::var("TASKBOX_REQUIRE_ALL").as_deref() != Ok("1"),
            "required prerequisite missing (TASKBOX_REQUIRE_ALL=1): {reason}"
        );
        eprintln!("SKIP: {reason}");
    }
    ok
}

/// A `kustomization.yaml`, of which the manifests use `resources` alone.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    api_version: String,
    kind: String,
    resources: Vec<String>,
}

/// A tree of manifests, read.
#[derive(Default)]
struct Tree {
    objects: Vec<Loaded>,
    /// Each top-level kustomization's directory, with the files it deploys.
    deployments: BTreeMap<String, BTreeSet<String>>,
    /// Files that are templates for the user (in no deployment).
    templates: BTreeSet<String>,
    errors: Vec<String>,
}

fn yaml_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            yaml_files(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.push(rel);
        }
    }
}

/// `base/../x` to `x`; `None` when it climbs out of the tree.
fn normalise(path: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for p in path.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(parts.join("/"))
}

fn dir_of(file: &str) -> &str {
    file.rsplit_once('/').map_or("", |(d, _)| d)
}

/// Reads every YAML file under `root`.
fn load(root: &Path) -> Tree {
    let mut tree = Tree::default();
    let mut files = Vec::new();
    yaml_files(root, root, &mut files);
    let mut kustomizations: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in &files {
        let text = fs::read_to_string(root.join(file)).unwrap();
        let docs = match yaml::documents(&text) {
            Ok(docs) => docs,
            Err(e) => {
                tree.errors.push(format!("{file}: {e}"));
                continue;
            }
        };
        if file.ends_with("kustomization.yaml") {
            let k = match docs.as_slice() {
                [doc] => {
                    serde_json::from_value::<Kustomization>(doc.clone()).map_err(|e| e.to_string())
                }
                _ => Err("one document expected".to_owned()),
            };
            match k {
                Ok(k)
                    if k.api_version == "kustomize.config.k8s.io/v1beta1"
                        && k.kind == "Kustomization" =>
                {
                    kustomizations.insert(dir_of(file).to_owned(), k.resources);
                }
                Ok(k) => tree.errors.push(format!(
                    "{file}: {} {} is not a Kustomization",
                    k.api_version, k.kind
                )),
                Err(e) => tree.errors.push(format!("{file}: {e}")),
            }
            continue;
        }
        if docs.is_empty() {
            tree.errors.push(format!("{file}: no document"));
        }
        for (i, doc) in docs.iter().enumerate() {
            match Object::parse(doc) {
                Ok(object) => tree.objects.push(Loaded {
                    file: file.clone(),
                    object,
                }),
                Err(e) => tree.errors.push(format!("{file}, document {}: {e}", i + 1)),
            }
        }
    }
    // Each kustomization's files, following the directories it includes.
    fn expand(
        dir: &str,
        ks: &BTreeMap<String, Vec<String>>,
        files: &[String],
        depth: usize,
        out: &mut BTreeSet<String>,
        errors: &mut Vec<String>,
    ) {
        for r in &ks[dir] {
            let joined = if dir.is_empty() {
                r.clone()
            } else {
                format!("{dir}/{r}")
            };
            match normalise(&joined) {
                Some(p) if ks.contains_key(&p) && depth < 8 => {
                    expand(&p, ks, files, depth + 1, out, errors)
                }
                Some(p) if files.contains(&p) && !p.ends_with("kustomization.yaml") => {
                    out.insert(p);
                }
                _ => errors.push(format!(
                    "{dir}/kustomization.yaml: resource {r} is no manifest or kustomization here"
                )),
            }
        }
    }
    let included: BTreeSet<String> = kustomizations
        .iter()
        .flat_map(|(dir, rs)| {
            rs.iter()
                .filter_map(move |r| normalise(&format!("{dir}/{r}")))
        })
        .collect();
    let mut deployed = BTreeSet::new();
    for dir in kustomizations.keys() {
        let mut out = BTreeSet::new();
        expand(dir, &kustomizations, &files, 0, &mut out, &mut tree.errors);
        deployed.extend(out.iter().cloned());
        if !included.contains(dir) {
            tree.deployments.insert(dir.clone(), out);
        }
    }
    for file in files
        .iter()
        .filter(|f| !f.ends_with("kustomization.yaml") && !deployed.contains(*f))
    {
        if file.ends_with(".example.yaml") {
            tree.templates.insert(file.clone());
        } else {
            tree.errors.push(format!(
                "{file}: in no kustomization (a template the user fills in is named *.example.yaml)"
            ));
        }
    }
    tree
}

/// Everything wrong with the manifests under `root`, and a summary of what was checked.
fn check_all(root: &Path) -> (Vec<String>, String) {
    let tree = load(root);
    let mut errors = tree.errors.clone();
    let templates: Vec<&Loaded> = tree
        .objects
        .iter()
        .filter(|l| tree.templates.contains(&l.file))
        .collect();
    let readme = fs::read_to_string(root.join("README.md")).unwrap_or_default();
    for t in &templates {
        if !readme.contains(t.object.name()) {
            errors.push(format!(
                "{}: the user supplies {} {}, which README.md does not name",
                t.file,
                t.object.kind(),
                t.object.name()
            ));
        }
    }
    if tree.deployments.is_empty() {
        errors.push("no top-level kustomization.yaml".to_owned());
    }
    for (dir, files) in &tree.deployments {
        let objects: Vec<&Loaded> = tree
            .objects
            .iter()
            .filter(|l| files.contains(&l.file))
            .collect();
        let runs = |what: &dyn Fn(&Object) -> bool| objects.iter().any(|l| what(&l.object));
        if !runs(&|o| matches!(o, Object::StatefulSet(_))) || !runs(&is_worker) {
            errors.push(format!("[{dir}] no NATS StatefulSet or no taskbox worker"));
        }
        errors.extend(
            refs::check(&objects, &templates)
                .into_iter()
                .map(|e| format!("[{dir}] {e}")),
        );
    }
    // A fault in base/ is found once per deployment that includes it: say it once.
    let mut seen = BTreeSet::new();
    errors.retain(|e| seen.insert(e.clone()));
    let summary = format!(
        "{} objects in {} deployments ({}), templates {:?}",
        tree.objects.len(),
        tree.deployments.len(),
        tree.deployments
            .keys()
            .cloned()
            .collect::<Vec<_>>()
            .join(", "),
        tree.templates
    );
    (errors, summary)
}

fn is_worker(o: &Object) -> bool {
    let Object::Deployment(d) = o else {
        return false;
    };
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .is_some_and(|p| {
            p.containers.iter().any(|c| {
                c.args
                    .as_ref()
                    .and_then(|a| a.first())
                    .is_some_and(|a| a == "worker")
            })
        })
}

#[test]
fn the_manifests_are_kubernetes_objects_that_fit_together() {
    let (errors, summary) = check_all(&deploy_dir());
    eprintln!("checked {summary}");
    assert!(errors.is_empty(), "docs/deploy:\n  {}", errors.join("\n  "));
}

/// The ConfigMap data of `key` in the manifests.
fn config_data(key_suffix: &str) -> Vec<(String, String)> {
    let tree = load(&deploy_dir());
    let mut out = Vec::new();
    for l in &tree.objects {
        if let Object::ConfigMap(c) = &l.object {
            for (k, v) in c.data.iter().flatten() {
                if k.ends_with(key_suffix) {
                    out.push((format!("{} {k}", l.object.name()), v.clone()));
                }
            }
        }
    }
    out
}

#[test]
fn nats_server_reads_the_nats_configuration() {
    let confs = config_data("nats.conf");
    assert_eq!(confs.len(), 1, "one nats.conf expected");
    // Debian puts it in /usr/sbin, which a user's PATH may lack.
    let path = std::env::var_os("PATH").unwrap_or_default();
    let bin = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file());
    let Some(bin) = bin else {
        require(
            false,
            "nats-server is not installed (scripts/ci.sh installs Debian's)",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in confs {
        let file = dir.path().join("nats.conf");
        fs::write(&file, &text).unwrap();
        let mut cmd = Command::new(&bin);
        cmd.arg("-t").arg("-c").arg(&file);
        // The variables the pod's env gives it (checked against the pod in refs.rs).
        for var in refs::nats_conf(&text).variables {
            cmd.env(var, "taskbox-nats-0");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{name}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_entrypoint_scripts_are_valid_sh() {
    let scripts = config_data(".sh");
    assert!(
        !scripts.is_empty(),
        "the Docker variant's entrypoint.sh was not found"
    );
    for (name, text) in scripts {
        let out = Command::new("sh")
            .arg("-n")
            .arg("-c")
            .arg(&text)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

// What the checks catch: each test breaks the real manifests one way.

fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let path = e.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_tree(&path, &target);
        } else {
            fs::copy(&path, &target).unwrap();
        }
    }
}

/// The errors after replacing the first `from` in `file` with `to`; `from` must be there.
fn errors_after(file: &str, from: &str, to: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&deploy_dir(), dir.path());
    let path = dir.path().join(file);
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{file} has no {from:?}");
    fs::write(&path, text.replacen(from, to, 1)).unwrap();
    let (errors, _) = check_all(dir.path());
    errors.join("\n")
}

fn caught(file: &str, from: &str, to: &str, said: &str) {
    let errors = errors_after(file, from, to);
    assert!(
        errors.contains(said),
        "{file}: {from:?} -> {to:?}: expected {said:?} in:\n{errors}"
    );
}

#[test]
fn a_misspelled_field_is_caught() {
    caught(
        "native/worker.yaml",
        "imagePullPolicy:",
        "imagePullPolicyy:",
        "containers[0].imagePullPolicyy: not a field here",
    );
}

#[test]
fn a_misplaced_field_is_caught() {
    // readOnly belongs to the volume mount, not to the ConfigMap volume.
    caught(
        "base/nats.yaml",
        "            name: taskbox-nats-config\n",
        "            name: taskbox-nats-config\n            readOnly: true\n",
        "volumes[0].configMap.readOnly: not a field here",
    );
}

#[test]
fn an_unknown_kind_and_a_yaml_1_1_boolean_are_caught() {
    caught(
        "base/worker.yaml",
        "kind: PodDisruptionBudget",
        "kind: PodDisruptionBudgets",
        "unknown kind",
    );
    caught(
        "base/nats.yaml",
        "publishNotReadyAddresses: true",
        "publishNotReadyAddresses: yes",
        "yes is a boolean to Kubernetes",
    );
}

#[test]
fn a_selector_that_selects_nothing_is_caught() {
    caught(
        "base/worker.yaml",
        "  selector:\n    app.kubernetes.io/name: taskbox-worker",
        "  selector:\n    app.kubernetes.io/name: taskbox-workers",
        "Service taskbox-worker-metrics: its selector selects no pod",
    );
}

#[test]
fn missing_references_are_caught() {
    caught(
        "native/worker.yaml",
        "key: base-url",
        "key: base_url",
        "key base_url of ConfigMap taskbox-model",
    );
    caught(
        "native/worker.yaml",
        "name: taskbox-model-key",
        "name: taskbox-model-keys",
        "Secret taskbox-model-keys, which is not defined",
    );
    caught(
        "native/worker.yaml",
        "port: metrics",
        "port: metric",
        "readinessProbe uses port String(\"metric\")",
    );
    caught(
        "docker/worker.yaml",
        "            name: taskbox-worker-docker\n",
        "            name: taskbox-worker-dockr\n",
        "ConfigMap taskbox-worker-dockr",
    );
}

#[test]
fn nats_routes_must_name_every_pod_of_the_set() {
    caught(
        "base/nats.yaml",
        "        \"nats://taskbox-nats-2.taskbox-nats-headless:6222\"\n",
        "",
        "no route to the pods {2}",
    );
    caught(
        "base/nats.yaml",
        "taskbox-nats-1.taskbox-nats-headless:6222",
        "taskbox-nats-1.taskbox-nats:6222",
        "route nats://taskbox-nats-1.taskbox-nats:6222",
    );
    caught(
        "base/nats.yaml",
        "store_dir: \"/data\"",
        "store_dir: \"/store\"",
        "store_dir",
    );
}

#[test]
fn the_worker_command_line_is_checked() {
    caught(
        "native/worker.yaml",
        "- --claim-timeout",
        "- --claim-timeoutt",
        "--claim-timeoutt is not a flag of taskbox worker",
    );
    caught(
        "native/worker.yaml",
        "nats://taskbox-nats:4222",
        "nats://taskbox-nats-headless:4222",
        "--nats names the headless Service",
    );
    caught(
        "docker/worker.yaml",
        "            - /var/lib/taskbox\n",
        "            - /var/lib/taskboxx\n",
        "--state-dir Some(\"/var/lib/taskboxx\") is no volume mount",
    );
    caught(
        "native/worker.yaml",
        "enableServiceLinks: false",
        "enableServiceLinks: true",
        "enableServiceLinks is not false",
    );
}

#[test]
fn what_the_api_server_would_refuse_is_caught() {
    caught(
        "native/worker.yaml",
        "allowPrivilegeEscalation: true",
        "allowPrivilegeEscalation: false",
        "allowPrivilegeEscalation false with SYS_ADMIN",
    );
    caught(
        "base/nats.yaml",
        "memory: 1Gi",
        "memory: 1GB",
        "\"1GB\" is no quantity",
    );
}

#[test]
fn a_file_outside_every_kustomization_is_caught() {
    caught(
        "native/kustomization.yaml",
        "  - worker.yaml\n",
        "",
        "native/worker.yaml: in no kustomization",
    );
}
