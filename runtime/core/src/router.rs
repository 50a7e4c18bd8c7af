//! [`BackendRouter`]: one [`SandboxApi`] over several backends, so one supervisor serves them
//! all. A create goes to the backend its request names (`backend`, default "native"); the
//! router remembers which backend owns each sandbox and sends every later call there. `list`
//! merges the backends' lists. (Its tests drive the real native and Docker backends, in the
//! Docker backend's suite.)

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use crate::api::*;

/// The backend used when a create request names none.
pub const DEFAULT_BACKEND: &str = "native";

/// Routes the narrow API to backends by name.
pub struct BackendRouter {
    backends: BTreeMap<String, Arc<dyn SandboxApi>>,
    owners: RwLock<HashMap<SandboxId, String>>,
}

impl std::fmt::Debug for BackendRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendRouter")
            .field("backends", &self.backends.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Default for BackendRouter {
    fn default() -> Self {
        Self::new()
    }
}

impl BackendRouter {
    pub fn new() -> BackendRouter {
        BackendRouter {
            backends: BTreeMap::new(),
            owners: RwLock::new(HashMap::new()),
        }
    }

    /// Adds (or replaces) the backend called `name`.
    pub fn with(mut self, name: impl Into<String>, backend: Arc<dyn SandboxApi>) -> Self {
        self.backends.insert(name.into(), backend);
        self
    }

    /// The names of the backends, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.backends.keys().map(String::as_str).collect()
    }

    fn remember(&self, id: &SandboxId, name: &str) {
        if let Ok(mut m) = self.owners.write() {
            m.insert(id.clone(), name.to_string());
        }
    }

    /// The backend owning `id`: the one recorded at create, else the first that knows it (a
    /// sandbox the router did not create, e.g. listed after a restart).
    fn owner(&self, id: &SandboxId) -> Result<&Arc<dyn SandboxApi>, ApiError> {
        let known = self.owners.read().ok().and_then(|m| m.get(id).cloned());
        if let Some(b) = known.and_then(|name| self.backends.get(&name)) {
            return Ok(b);
        }
        for (name, b) in &self.backends {
            if b.info(id).is_ok() {
                self.remember(id, name);
                return Ok(b);
            }
        }
        Err(ApiError::sandbox_not_found(id))
    }
}

impl OpHandler for BackendRouter {
    fn handle_create(&self, req: CreateRequest) -> Result<SandboxInfo, ApiError> {
        let name = req
            .backend
            .clone()
            .unwrap_or_else(|| DEFAULT_BACKEND.to_string());
        let backend = self.backends.get(&name).ok_or_else(|| {
            let hint = if name == "docker" {
                " (a supervisor serves docker when started with `taskbox serve --docker`)"
            } else {
                ""
            };
            ApiError::invalid(format!(
                "backend {name:?} is not available here; available: {}{hint}",
                self.names().join(", ")
            ))
        })?;
        let info = backend.create(req)?;
        self.remember(&info.id, &name);
        Ok(info)
    }

    fn handle_list(&self) -> Vec<SandboxInfo> {
        let mut all = Vec::new();
        for (name, b) in &self.backends {
            for info in b.list() {
                self.remember(&info.id, name);
                all.push(info);
            }
        }
        all.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then(a.id.cmp(&b.id)));
        all
    }

    fn handle(&self, id: &SandboxId, op: Op<'_>) -> Result<Answer, ApiError> {
        let destroy = matches!(op, Op::Destroy);
        let backend = self.owner(id)?;
        let r = backend.call(id, op);
        // Forks live in their parent's backend.
        if let Ok(Answer::Fork(forked)) = &r
            && let Some(name) = self.owners.read().ok().and_then(|m| m.get(id).cloned())
        {
            for f in &forked.sandboxes {
                self.remember(&f.id, &name);
            }
        }
        if destroy
            && r.is_ok()
            && let Ok(mut m) = self.owners.write()
        {
            m.remove(id);
        }
        r
    }
}
