//! Filtered node listings (the technicians' board and the API's `GET /nodes`) and the
//! operator labels they filter on. Every filter is SQL: a board over thousands of
//! nodes reads one page of rows, never the whole inventory.

use std::collections::{BTreeMap, HashMap};

use super::nodes::{InterfaceRow, NodeRow};
use super::{Db, Store, StoreError};
use crate::lifecycle::transition::State;
use crate::model::{Mac, NodeArch};

/// Labels of one node, by key.
pub type Labels = BTreeMap<String, String>;

/// What a listing is filtered on; `None` (or empty) is "any".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFilter {
    pub state: Option<State>,
    pub arch: Option<NodeArch>,
    /// `key` (the node has the label) or `key=value`.
    pub label: Option<(String, Option<String>)>,
    /// Free text: part of a MAC (any separators), of the name or of the hostname.
    pub text: Option<String>,
    /// Held to this hardware profile.
    pub profile: Option<String>,
    /// Lost hardware since its baseline (`true`) or not (`false`).
    pub drifted: Option<bool>,
    /// Served by this site (the `site` of the instance that last saw it netboot).
    pub site: Option<String>,
}

impl NodeFilter {
    /// Parses a `label=` query value: `rack=r12` or `rack`.
    pub fn label_of(s: &str) -> Option<(String, Option<String>)> {
        let s = s.trim();
        if s.is_empty() {
            return None;
        }
        Some(match s.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), Some(v.trim().to_string())),
            None => (s.to_string(), None),
        })
    }
}

/// `%text%` for LIKE, with LIKE's own wildcards taken literally (escape `\`).
fn like(text: &str) -> String {
    let mut s = String::from("%");
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('%');
    s
}

/// The hex digits of a MAC fragment (`52:54`, `52-54`, `5254`), lower case, or `None`
/// when the text is not one (then it only matches names).
fn mac_fragment(text: &str) -> Option<String> {
    let hex: String = text
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect::<String>()
        .to_ascii_lowercase();
    (!hex.is_empty() && hex.len() <= 12 && hex.chars().all(|c| c.is_ascii_hexdigit()))
        .then_some(hex)
}

/// Label key and value rules (the table's CHECK, said in words).
pub fn check_label(key: &str, value: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > 64 {
        return Err(format!("label key `{key}` must be 1 to 64 characters"));
    }
    if !key
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    {
        return Err(format!(
            "label key `{key}` may hold letters, digits, `-`, `_`, `.` and `/` only"
        ));
    }
    if value.len() > 128 || value.chars().any(char::is_control) {
        return Err(format!(
            "label value of `{key}` must be at most 128 printable characters"
        ));
    }
    Ok(())
}

/// Each node with its MACs (`ifaces` by node, boot NIC first) and labels.
fn listing(
    nodes: Vec<NodeRow>,
    ifaces: Vec<InterfaceRow>,
    labels: Vec<(i64, String, String)>,
) -> Vec<(NodeRow, Vec<Mac>, Labels)> {
    let mut macs: HashMap<i64, Vec<Mac>> = HashMap::new();
    for i in ifaces {
        macs.entry(i.node_id).or_default().push(i.mac);
    }
    let mut by_node: HashMap<i64, Labels> = HashMap::new();
    for (node, k, v) in labels {
        by_node.entry(node).or_default().insert(k, v);
    }
    nodes
        .into_iter()
        .map(|n| {
            let m = macs.remove(&n.id).unwrap_or_default();
            let l = by_node.remove(&n.id).unwrap_or_default();
            (n, m, l)
        })
        .collect()
}

impl Store {
    /// Nodes with an id above `after`, in id order, at most `limit`, that match
    /// `filter`; each with its MACs (boot MAC first) and labels. Three queries
    /// however many nodes match.
    pub async fn nodes_filtered(
        &self,
        after: i64,
        limit: u32,
        filter: &NodeFilter,
    ) -> Result<Vec<(NodeRow, Vec<Mac>, Labels)>, StoreError> {
        let limit = i64::from(limit);
        let arch = filter.arch;
        let (label_key, label_value) = match &filter.label {
            Some((k, v)) => (Some(k.as_str()), v.as_deref()),
            None => (None, None),
        };
        let text = filter
            .text
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let name_like = text.map(like);
        let mac_like = text.and_then(mac_fragment).map(|h| like(&h));
        let profile = filter.profile.as_deref();
        let drifted = filter.drifted;
        let site = filter.site.as_deref();
        if let Db::Postgres(pg) = &self.db {
            let f = store_pg::board::Filter {
                state: filter.state,
                arch,
                label_key,
                label_value,
                name_like,
                mac_like,
                profile,
                drifted,
                site,
            };
            let nodes = pg.nodes_filtered(after, limit, &f).await?;
            if nodes.is_empty() {
                return Ok(vec![]);
            }
            let ids: Vec<i64> = nodes.iter().map(|n| n.id).collect();
            let ifaces = pg.interfaces_of(&ids).await?;
            let labels = pg.labels_of(&ids).await?;
            return Ok(listing(nodes, ifaces, labels));
        }
        let nodes = sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site
               FROM nodes
               WHERE id > ?1
                 AND (?2 IS NULL OR state = ?2)
                 AND (?3 IS NULL OR arch = ?3)
                 AND (?4 IS NULL OR EXISTS (SELECT 1 FROM node_labels l WHERE l.node_id = nodes.id AND l.key = ?4 AND (?5 IS NULL OR l.value = ?5)))
                 AND (?6 IS NULL
                      OR name LIKE ?6 ESCAPE '\' OR hostname LIKE ?6 ESCAPE '\'
                      OR (?7 IS NOT NULL AND EXISTS (SELECT 1 FROM interfaces i WHERE i.node_id = nodes.id AND replace(i.mac, ':', '') LIKE ?7 ESCAPE '\')))
                 AND (?9 IS NULL OR EXISTS (SELECT 1 FROM node_hardware h WHERE h.node_id = nodes.id AND h.profile = ?9))
                 AND (?10 IS NULL OR COALESCE((SELECT h.drifted FROM node_hardware h WHERE h.node_id = nodes.id), 0) = ?10)
                 AND (?11 IS NULL OR site = ?11)
               ORDER BY id LIMIT ?8"#,
            after,
            filter.state,
            arch,
            label_key,
            label_value,
            name_like,
            mac_like,
            limit,
            profile,
            drifted,
            site
        )
        .fetch_all(self.pool()?)
        .await?;
        if nodes.is_empty() {
            return Ok(vec![]);
        }
        let ids = serde_json::to_string(&nodes.iter().map(|n| n.id).collect::<Vec<_>>())
            .unwrap_or_else(|_| "[]".into());
        let ifaces = sqlx::query_as!(
            InterfaceRow,
            r#"SELECT mac AS "mac: _", node_id, is_boot AS "is_boot: _" FROM interfaces WHERE node_id IN (SELECT value FROM json_each(?)) ORDER BY node_id, is_boot DESC, mac"#,
            ids
        )
        .fetch_all(self.pool()?)
        .await?;
        let labels = sqlx::query!(
            r#"SELECT node_id, key, value FROM node_labels WHERE node_id IN (SELECT value FROM json_each(?)) ORDER BY node_id, key"#,
            ids
        )
        .fetch_all(self.pool()?)
        .await?;
        let labels = labels.into_iter().map(|l| (l.node_id, l.key, l.value));
        Ok(listing(nodes, ifaces, labels.collect()))
    }

    /// The labels of one node.
    pub async fn labels(&self, node_id: i64) -> Result<Labels, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let rows = pg.labels_of(&[node_id]).await?;
            return Ok(rows.into_iter().map(|(_, k, v)| (k, v)).collect());
        }
        let rows = sqlx::query!(
            "SELECT key, value FROM node_labels WHERE node_id = ? ORDER BY key",
            node_id
        )
        .fetch_all(self.pool()?)
        .await?;
        Ok(rows.into_iter().map(|r| (r.key, r.value)).collect())
    }

    /// Replaces the labels of a node (checked with [`check_label`] by the caller).
    pub async fn set_labels(&self, node_id: i64, labels: &Labels) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let pairs: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            return Ok(pg.set_labels(node_id, &pairs).await?);
        }
        let mut tx = self.write().await?;
        sqlx::query!("DELETE FROM node_labels WHERE node_id = ?", node_id)
            .execute(&mut *tx)
            .await?;
        for (k, v) in labels {
            sqlx::query!(
                "INSERT INTO node_labels (node_id, key, value) VALUES (?, ?, ?)",
                node_id,
                k,
                v
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records that an instance of `site` saw nodes `ids` netboot: each is now served
    /// by `site`. Returns how many changed site (a node already there is not written).
    pub async fn set_sites(&self, site: &str, ids: &[i64]) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.set_sites(site, ids).await?);
        }
        let ids = serde_json::to_string(ids).unwrap_or_else(|_| "[]".into());
        let mut tx = self.write().await?;
        let done = sqlx::query!(
            "UPDATE nodes SET site = ?1 WHERE id IN (SELECT value FROM json_each(?2)) AND site IS NOT ?1",
            site,
            ids
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::nodes::NewNode;

    async fn node(store: &Store, mac: &str, name: Option<&str>, arch: NodeArch) -> i64 {
        store
            .create_node(
                &NewNode {
                    name: name.map(str::to_string),
                    arch,
                    state: State::Available,
                    macs: vec![mac.parse().unwrap()],
                    boot_mac: None,
                    bmc: None,
                    ssh_authorized_keys: vec![],
                },
                "test",
            )
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn filters_are_sql_and_combine() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        let arm = NodeArch(Some(crate::model::Arch::Arm64));
        let x86 = NodeArch(Some(crate::model::Arch::X86_64));
        let a = node(&store, "52:54:00:12:00:01", Some("gpu-a"), arm).await;
        let b = node(&store, "52:54:00:12:00:02", Some("cpu_b"), x86).await;
        let c = node(&store, "aa:bb:cc:00:00:03", None, arm).await;
        let r12: Labels = [("rack".to_string(), "r12".to_string())].into();
        store.set_labels(a, &r12).await.unwrap();
        store.set_labels(c, &r12).await.unwrap();
        store
            .set_labels(b, &[("rack".to_string(), "r13".to_string())].into())
            .await
            .unwrap();
        let ids = |f: NodeFilter| {
            let store = store.clone();
            async move {
                store
                    .nodes_filtered(0, 100, &f)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|(n, _, _)| n.id)
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(ids(NodeFilter::default()).await, [a, b, c]);
        let f = |label: &str, text: Option<&str>, arch| NodeFilter {
            label: NodeFilter::label_of(label),
            text: text.map(str::to_string),
            arch,
            ..NodeFilter::default()
        };
        assert_eq!(ids(f("rack=r12", None, None)).await, [a, c]);
        assert_eq!(ids(f("rack", None, None)).await, [a, b, c]);
        assert_eq!(ids(f("rack=r12", None, Some(arm))).await, [a, c]);
        assert_eq!(ids(f("", None, Some(x86))).await, [b]);
        // MAC fragments with any separator, and names; `_` is not a wildcard.
        assert_eq!(ids(f("", Some("52:54"), None)).await, [a, b]);
        assert_eq!(ids(f("", Some("00-00-03"), None)).await, [c]);
        assert_eq!(ids(f("", Some("GPU"), None)).await, [a]);
        assert_eq!(ids(f("", Some("u_b"), None)).await, [b]);
        assert_eq!(ids(f("", Some("p_a"), None)).await, Vec::<i64>::new());
        assert_eq!(
            ids(f("rack=r13", Some("gpu"), None)).await,
            Vec::<i64>::new()
        );
        let s = NodeFilter {
            state: Some(State::Failed),
            ..NodeFilter::default()
        };
        assert!(ids(s).await.is_empty());
        // Hardware: a held to profile hgx and as accepted, b drifted, c never checked.
        use crate::inventory::gate::Verdict;
        use crate::inventory::{Change, ChangeKind};
        let ok = Verdict {
            profile: Some("hgx".into()),
            ..Verdict::default()
        };
        store
            .record_gate(a, 1, State::FirstBoot, &ok)
            .await
            .unwrap();
        let lost = Verdict {
            changes: vec![Change {
                what: "pci 0000:18:00.0".into(),
                kind: ChangeKind::Removed,
                before: "[10de:2330]".into(),
                after: String::new(),
                degraded: true,
            }],
            ..Verdict::default()
        };
        store
            .record_gate(b, 1, State::FirstBoot, &lost)
            .await
            .unwrap();
        let hw = |profile: Option<&str>, drifted| NodeFilter {
            profile: profile.map(str::to_string),
            drifted,
            ..NodeFilter::default()
        };
        assert_eq!(ids(hw(Some("hgx"), None)).await, [a]);
        assert_eq!(ids(hw(None, Some(true))).await, [b]);
        assert_eq!(ids(hw(None, Some(false))).await, [a, c]);
        assert_eq!(ids(hw(Some("hgx"), Some(true))).await, Vec::<i64>::new());
        // Sites: set where they differ only; a filter of their own.
        assert_eq!(store.set_sites("room-a", &[a, c]).await.unwrap(), 2);
        assert_eq!(store.set_sites("room-a", &[a, c]).await.unwrap(), 0);
        assert_eq!(store.set_sites("room-b", &[c]).await.unwrap(), 1);
        let site = |s: &str| NodeFilter {
            site: Some(s.to_string()),
            ..NodeFilter::default()
        };
        assert_eq!(ids(site("room-a")).await, [a]);
        assert_eq!(ids(site("room-b")).await, [c]);
        assert_eq!(
            store.node(c).await.unwrap().unwrap().site.as_deref(),
            Some("room-b")
        );
        assert_eq!(store.node(b).await.unwrap().unwrap().site, None);
        // Paging: after and limit, and each row has its MACs and labels.
        let page = store
            .nodes_filtered(a, 1, &NodeFilter::default())
            .await
            .unwrap();
        assert_eq!(page.len(), 1);
        assert_eq!(page[0].0.id, b);
        assert_eq!(page[0].1, ["52:54:00:12:00:02".parse::<Mac>().unwrap()]);
        assert_eq!(page[0].2["rack"], "r13");
        assert_eq!(store.labels(c).await.unwrap(), r12);
        assert!(check_label("rack", "r12").is_ok());
        assert!(check_label("ra ck", "r12").is_err());
        assert!(check_label("", "x").is_err());
    }
}
