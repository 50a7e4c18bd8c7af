//! Each document as the Kubernetes API object its `apiVersion` and `kind` name, from the
//! `k8s-openapi` types, read strictly.
//!
//! Those types' deserializers skip fields they do not know, as the API server does for a
//! client that does not ask for strict decoding; so a misspelled `imagePullPolicyy`, or a
//! `livenessProbe` one level too deep, would pass unseen. Each object is therefore written back
//! and compared with the document: a key the document has and the typed object does not is
//! a field that is not there in the API. The only differences let through are the ones that
//! change nothing: a number given where the type keeps a string of it (a quantity `cpu: 2`),
//! and the `apiVersion` and `kind` the types write for an object embedded in another.

use k8s_openapi::Resource;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolumeClaim, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The kinds the manifests use. Another kind is refused: add it here (and to the checks in
/// `refs.rs` that concern it) when a manifest needs it.
#[derive(Debug)]
pub enum Object {
    Namespace(Namespace),
    ConfigMap(ConfigMap),
    Secret(Secret),
    Service(Service),
    ServiceAccount(ServiceAccount),
    PersistentVolumeClaim(PersistentVolumeClaim),
    Deployment(Deployment),
    StatefulSet(StatefulSet),
    PodDisruptionBudget(PodDisruptionBudget),
    NetworkPolicy(NetworkPolicy),
}

impl Object {
    /// Reads `doc` as the object its `apiVersion` and `kind` name.
    pub fn parse(doc: &Value) -> Result<Object, String> {
        let field = |name: &str| {
            doc.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("no {name}"))
        };
        let (api_version, kind) = (field("apiVersion")?, field("kind")?);
        fn is<K: Resource>(api_version: &str, kind: &str) -> bool {
            api_version == K::API_VERSION && kind == K::KIND
        }
        let object = if is::<Namespace>(api_version, kind) {
            Object::Namespace(strict(doc)?)
        } else if is::<ConfigMap>(api_version, kind) {
            Object::ConfigMap(strict(doc)?)
        } else if is::<Secret>(api_version, kind) {
            Object::Secret(strict(doc)?)
        } else if is::<Service>(api_version, kind) {
            Object::Service(strict(doc)?)
        } else if is::<ServiceAccount>(api_version, kind) {
            Object::ServiceAccount(strict(doc)?)
        } else if is::<PersistentVolumeClaim>(api_version, kind) {
            Object::PersistentVolumeClaim(strict(doc)?)
        } else if is::<Deployment>(api_version, kind) {
            Object::Deployment(strict(doc)?)
        } else if is::<StatefulSet>(api_version, kind) {
            Object::StatefulSet(strict(doc)?)
        } else if is::<PodDisruptionBudget>(api_version, kind) {
            Object::PodDisruptionBudget(strict(doc)?)
        } else if is::<NetworkPolicy>(api_version, kind) {
            Object::NetworkPolicy(strict(doc)?)
        } else {
            return Err(format!(
                "unknown kind {kind} of {api_version} (the manifests' kinds are listed in \
                 tests/deploy/kube.rs)"
            ));
        };
        let meta = object.meta();
        if meta.name.as_deref().is_none_or(str::is_empty) {
            return Err(format!("{kind} without metadata.name"));
        }
        let namespaced = !matches!(object, Object::Namespace(_));
        if namespaced && meta.namespace.is_none() {
            return Err(format!(
                "{kind} {} without metadata.namespace (say it, so `kubectl apply -f` puts it \
                 where `-k` does)",
                object.name()
            ));
        }
        Ok(object)
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Object::Namespace(_) => Namespace::KIND,
            Object::ConfigMap(_) => ConfigMap::KIND,
            Object::Secret(_) => Secret::KIND,
            Object::Service(_) => Service::KIND,
            Object::ServiceAccount(_) => ServiceAccount::KIND,
            Object::PersistentVolumeClaim(_) => PersistentVolumeClaim::KIND,
            Object::Deployment(_) => Deployment::KIND,
            Object::StatefulSet(_) => StatefulSet::KIND,
            Object::PodDisruptionBudget(_) => PodDisruptionBudget::KIND,
            Object::NetworkPolicy(_) => NetworkPolicy::KIND,
        }
    }

    pub fn meta(&self) -> &ObjectMeta {
        match self {
            Object::Namespace(o) => &o.metadata,
            Object::ConfigMap(o) => &o.metadata,
            Object::Secret(o) => &o.metadata,
            Object::Service(o) => &o.metadata,
            Object::ServiceAccount(o) => &o.metadata,
            Object::PersistentVolumeClaim(o) => &o.metadata,
            Object::Deployment(o) => &o.metadata,
            Object::StatefulSet(o) => &o.metadata,
            Object::PodDisruptionBudget(o) => &o.metadata,
            Object::NetworkPolicy(o) => &o.metadata,
        }
    }

    pub fn name(&self) -> &str {
        self.meta().name.as_deref().unwrap_or_default()
    }

    pub fn namespace(&self) -> Option<&str> {
        self.meta().namespace.as_deref()
    }
}

/// `doc` as a `K`, refused when writing that `K` back does not give `doc` again.
fn strict<K: DeserializeOwned + Serialize>(doc: &Value) -> Result<K, String> {
    let typed: K = serde_path_to_error::deserialize(doc).map_err(|e| {
        let path = e.path().to_string();
        format!("at {path}: {}", e.into_inner())
    })?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("cannot write it back: {e}"))?;
    let mut diffs = Vec::new();
    compare(doc, &back, "", &mut diffs);
    if diffs.is_empty() {
        Ok(typed)
    } else {
        Err(diffs.join("; "))
    }
}

/// Appends to `diffs` every place where `back` (the typed object written back) differs from
/// `doc` (what the manifest says).
pub fn compare(doc: &Value, back: &Value, path: &str, diffs: &mut Vec<String>) {
    let here = |p: &str| {
        if p.is_empty() {
            ".".to_owned()
        } else {
            p.to_owned()
        }
    };
    match (doc, back) {
        (Value::Object(d), Value::Object(b)) => {
            for (key, dv) in d {
                let p = format!("{path}.{key}");
                match b.get(key) {
                    Some(bv) => compare(dv, bv, &p, diffs),
                    None if dv.is_null() => diffs.push(format!(
                        "{p}: null (leave the key out, or write {{}} for an empty object)"
                    )),
                    None => diffs.push(format!(
                        "{p}: not a field here (misspelled, or at the wrong level?)"
                    )),
                }
            }
            for key in b.keys().filter(|k| !d.contains_key(*k)) {
                // An object of a top-level kind inside another (a StatefulSet's
                // volumeClaimTemplates) is written with its apiVersion and kind, which the API
                // takes or leaves out alike.
                let embedded_type = !path.is_empty() && (key == "apiVersion" || key == "kind");
                if !embedded_type {
                    diffs.push(format!("{path}.{key}: added when written back"));
                }
            }
        }
        (Value::Array(d), Value::Array(b)) if d.len() == b.len() => {
            for (i, (dv, bv)) in d.iter().zip(b).enumerate() {
                compare(dv, bv, &format!("{path}[{i}]"), diffs);
            }
        }
        // A quantity or a string given as a number: the same text either way.
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        (d, b) if d == b => {}
        (d, b) => diffs.push(format!("{}: {d} was read as {b}", here(path))),
    }
}

#[cfg(test)]
mod tests {
    use super::Object;
    use serde_json::json;

    fn deployment(container: serde_json::Value) -> serde_json::Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "n"},
            "spec": {
                "selector": {"matchLabels": {"a": "b"}},
                "template": {
                    "metadata": {"labels": {"a": "b"}},
                    "spec": {"containers": [container]}
                }
            }
        })
    }

    #[test]
    fn a_good_object_round_trips() {
        let doc = deployment(json!({
            "name": "c", "image": "i:1",
            "resources": {"limits": {"cpu": 2, "memory": "1Gi"}},
            "ports": [{"name": "http", "containerPort": 80}]
        }));
        Object::parse(&doc).unwrap();
    }

    #[test]
    fn misspelled_and_misplaced_fields_are_named() {
        let doc = deployment(json!({"name": "c", "image": "i:1", "imagePullPolicyy": "Always"}));
        let err = Object::parse(&doc).unwrap_err();
        assert!(
            err.contains(".spec.template.spec.containers[0].imagePullPolicyy: not a field"),
            "{err}"
        );
        // A probe one level too deep: under the port instead of the container.
        let doc = deployment(json!({
            "name": "c", "image": "i:1",
            "ports": [{"containerPort": 80, "readinessProbe": {"tcpSocket": {"port": 80}}}]
        }));
        let err = Object::parse(&doc).unwrap_err();
        assert!(
            err.contains("ports[0].readinessProbe: not a field"),
            "{err}"
        );
    }

    #[test]
    fn wrong_types_unknown_kinds_and_missing_names_are_refused() {
        let doc =
            deployment(json!({"name": "c", "image": "i:1", "ports": [{"containerPort": "80"}]}));
        let err = Object::parse(&doc).unwrap_err();
        assert!(err.contains("containerPort"), "{err}");
        let err =
            Object::parse(&json!({"apiVersion": "v1", "kind": "Pods", "metadata": {"name": "p"}}))
                .unwrap_err();
        assert!(err.contains("unknown kind Pods"), "{err}");
        let err = Object::parse(&json!({"apiVersion": "apps/v1beta1", "kind": "Deployment"}))
            .unwrap_err();
        assert!(err.contains("unknown kind"), "{err}");
        let err = Object::parse(
            &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}),
        )
        .unwrap_err();
        assert!(err.contains("without metadata.namespace"), "{err}");
    }
}
