//! One conformance suite for every state store backend: each test below
//! runs on SQLite (a temporary file) and on PostgreSQL (a database of its
//! own on the throwaway cluster `cairn_state::testing` starts, or on
//! `CAIRN_TEST_POSTGRES`).

use std::sync::{Arc, Barrier};
use std::time::Duration;

use cairn_state::access::{Claim, TokenRecord};
use cairn_state::e2b::{E2bLife, E2bSandbox, E2bSnapshot};
use cairn_state::lineage::EventData;
use cairn_state::runs::{ArtifactRecord, DeadLetter, DecisionEffect, DecisionRecord, NewEvent, RunRecord, StageRecord};
use cairn_state::session_log::{Entry, EntryKind, Order, Rewind, Segment, GENESIS};
use cairn_state::sessions::{SessionRecord, SessionState};
use cairn_state::tenants::{AuditEntry, Owned, TenantRecord};
use cairn_state::testing::{self, TestDatabase};
use cairn_state::{BackendKind, Db, Value};
use cairn_state::{Home, ImageRecord, SandboxRecord, SandboxState, SnapshotRecord, StateError};

/// A state store to test: a state directory and, for PostgreSQL, its database.
struct Store {
    kind: BackendKind,
    dir: tempfile::TempDir,
    db: Option<TestDatabase>,
}

impl Store {
    fn sqlite() -> Store {
        Store {
            kind: BackendKind::Sqlite,
            dir: tempfile::tempdir().unwrap(),
            db: None,
        }
    }

    fn postgres(test: &str) -> Option<Store> {
        Some(Store {
            kind: BackendKind::Postgres,
            dir: tempfile::tempdir().unwrap(),
            db: Some(testing::postgres_database(test)?),
        })
    }

    fn home(&self) -> Home {
        let home = Home::at(self.dir.path());
        match &self.db {
            Some(db) => home.with_state(&db.url),
            None => home,
        }
    }

    /// A new connection to the store.
    fn open(&self) -> Db {
        let db = Db::open_home(&self.home()).unwrap_or_else(|e| panic!("open the {:?} store: {e}", self.kind));
        assert_eq!(db.kind(), self.kind);
        db
    }

    fn set_schema_version(&self, db: &Db, version: i64) {
        let sql = match self.kind {
            BackendKind::Sqlite => format!("PRAGMA user_version = {version}"),
            BackendKind::Postgres => format!("UPDATE cairn_schema SET version = {version}"),
        };
        db.with(|b| Ok(b.batch(&sql)?)).unwrap();
    }
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[test]
                fn $name() {
                    super::$name(&super::Store::sqlite());
                }
            )*
        }
        mod postgres {
            $(
                #[test]
                fn $name() {
                    if let Some(store) = super::Store::postgres(stringify!($name)) {
                        super::$name(&store);
                    }
                }
            )*
        }
    };
}

conformance!(
    orphans_are_sandboxes_whose_claim_moved_on_that_no_stage_row_names,
    artifacts_are_pending_until_their_stage_completes_under_the_claim_that_made_them,
    sandboxes_round_trip_with_every_field_and_their_layers_in_order,
    a_taken_name_is_refused_and_leaves_the_store_usable,
    invalid_transitions_name_both_states_and_lost_races_conflict,
    owners_change_only_by_compare_and_set,
    of_concurrent_transitions_from_several_connections_exactly_one_wins,
    a_transition_waits_for_a_concurrent_transaction_then_conflicts,
    images_are_replaced_whole_and_keep_layer_order,
    layers_stay_referenced_while_an_image_sandbox_or_snapshot_names_them,
    snapshots_keep_parents_labels_and_layers,
    runs_are_found_by_prefix_finished_and_deleted_with_everything,
    stages_upsert_and_record_the_first_completion_of_a_key,
    checkpoints_newest_wins_even_within_one_millisecond,
    artifacts_are_replaced_by_id_and_listed_per_run,
    dead_letters_round_trip_and_remember_their_retry,
    events_keep_their_order_and_snapshots,
    typed_events_keep_their_fields_and_a_won_event_names_its_branch,
    a_newer_schema_is_refused,
    a_failing_transaction_leaves_nothing,
    reopening_keeps_everything,
    stores_opened_at_once_migrate_once,
    tokens_are_found_by_hash_only_and_revoked_by_id_or_name,
    an_idempotency_key_answers_once_and_refuses_another_body,
    e2b_sandboxes_keep_their_id_through_pause_and_resume,
    e2b_snapshots_are_listed_oldest_first_and_deleted_once,
    e2b_template_builds_take_their_tags_only_when_ready,
    sessions_round_trip_are_found_by_name_or_prefix_and_names_are_unique,
    session_moves_are_compare_and_set_on_state_and_owner,
    log_entries_get_gapless_seqs_and_a_hash_chain_and_rewinds_hide_ranges,
    concurrent_appenders_never_leave_a_gap_or_a_duplicate,
    a_long_log_reads_by_range_and_tail_around_abandoned_stretches,
    idle_sessions_are_active_ones_past_their_timeout,
    an_imported_session_is_recorded_whole_or_not_at_all,
    decisions_are_recorded_with_their_effect_in_one_transaction,
    a_snapshot_is_marked_durable_in_the_remote_store_once,
    a_job_is_claimed_by_one_worker_at_a_time_and_a_stale_claim_commits_nothing,
    concurrent_claims_take_each_job_once,
    an_expired_claim_taken_over_before_the_reaper_records_its_expiry,
    sandboxes_are_listed_and_found_only_on_their_home,
    rows_without_a_home_are_adopted_by_the_next_open,
    what_a_tenant_inserts_is_its_own_and_its_lookups_see_nothing_else,
    tenant_limits_hold_against_creates_racing_for_the_last_slot,
    removing_a_tenant_ends_its_tokens_and_leaves_nothing_without_an_owner,
    audit_rows_are_kept_in_order_per_tenant_and_pruned_by_age,
);

fn tenant(name: &str, max_sandboxes: Option<i64>, max_memory: Option<i64>) -> TenantRecord {
    TenantRecord {
        name: name.into(),
        max_sandboxes,
        max_memory,
        max_disk: None,
        created_at: 1,
    }
}

fn what_a_tenant_inserts_is_its_own_and_its_lookups_see_nothing_else(store: &Store) {
    let mut db = store.open();
    db.insert_tenant(&tenant("acme", None, None)).unwrap();
    db.insert_tenant(&tenant("globex", None, None)).unwrap();
    assert!(
        db.insert_tenant(&tenant("acme", None, None)).is_err(),
        "a tenant's name is taken once"
    );
    // The administrator's image is shared; each tenant's is its own.
    let image = |name: &str| ImageRecord {
        name: name.into(),
        source: "test".into(),
        size_bytes: 1,
        created_at: 1,
        layers: vec!["l".into()],
        config: None,
    };
    db.put_image(&image("shared")).unwrap();
    db.act_for(Some("acme".into()));
    db.insert_sandbox(&sandbox("aaa111", "a-box")).unwrap();
    db.insert_snapshot(&snapshot("aaaa5555", None, "aaa111", Some("base"), 1))
        .unwrap();
    db.insert_session(&session("aaas01", "a-session")).unwrap();
    db.insert_run(&run("aaar01", 1)).unwrap();
    db.put_image(&image("acme-img")).unwrap();
    assert!(
        matches!(db.put_image(&image("shared")), Err(StateError::NameOfAnother(n)) if n == "shared"),
        "a tenant cannot replace the administrator's image"
    );
    db.act_for(Some("globex".into()));
    db.insert_sandbox(&sandbox("aaa222", "g-box")).unwrap();
    assert!(
        matches!(db.put_image(&image("acme-img")), Err(StateError::NameOfAnother(_))),
        "nor another tenant's"
    );
    // Globex's lookups see none of Acme's objects, even by exact id.
    assert!(db.find_sandboxes("aaa111").unwrap().is_empty());
    assert!(db.find_sandboxes("a-box").unwrap().is_empty());
    assert_eq!(
        db.find_sandboxes("aaa")
            .unwrap()
            .iter()
            .map(|r| r.id.as_str())
            .collect::<Vec<_>>(),
        ["aaa222"],
        "a prefix shared with another tenant's id matches its own only"
    );
    assert!(db.find_snapshots("aaaa5555").unwrap().is_empty());
    assert!(db.find_snapshots("base").unwrap().is_empty());
    assert!(db.find_sessions("a-session").unwrap().is_empty());
    assert!(db.find_runs("aaar01").unwrap().is_empty());
    assert!(db.image("acme-img").unwrap().is_none());
    assert!(
        db.image("shared").unwrap().is_some(),
        "the administrator's images are shared"
    );
    let names: Vec<String> = db.images().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["shared"]);
    // Acme's find its own; the administrator finds everything.
    db.act_for(Some("acme".into()));
    assert_eq!(db.find_sandboxes("aaa").unwrap().len(), 1);
    assert_eq!(db.find_snapshots("base").unwrap().len(), 1);
    assert_eq!(db.images().unwrap().len(), 2);
    db.act_for(None);
    assert_eq!(db.find_sandboxes("aaa").unwrap().len(), 2);
    assert_eq!(db.images().unwrap().len(), 2, "acme-img and shared");
    assert_eq!(db.tenant_of(Owned::Sandbox, "aaa111").unwrap().as_deref(), Some("acme"));
    assert_eq!(
        db.tenant_of(Owned::Snapshot, "aaaa5555").unwrap().as_deref(),
        Some("acme")
    );
    assert_eq!(db.tenant_of(Owned::Session, "aaas01").unwrap().as_deref(), Some("acme"));
    assert_eq!(db.tenant_of(Owned::Run, "aaar01").unwrap().as_deref(), Some("acme"));
    assert_eq!(db.tenant_of(Owned::Image, "acme-img").unwrap().as_deref(), Some("acme"));
    assert_eq!(db.tenant_of(Owned::Image, "shared").unwrap(), None);
    // A tenant finds the names it gave by their qualified form too.
    db.act_for(Some("globex".into()));
    db.insert_sandbox(&sandbox("ggg333", "globex-web")).unwrap();
    assert_eq!(db.find_sandboxes("web").unwrap()[0].id, "ggg333");
    assert_eq!(db.find_sandboxes("globex-web").unwrap()[0].id, "ggg333");
    db.insert_session(&session("ggs01", "globex-agent")).unwrap();
    assert_eq!(db.find_sessions("agent").unwrap()[0].id, "ggs01");
    assert_eq!(db.resolve_owned(Owned::Sandbox, "globex", "web").unwrap(), ["ggg333"]);
    assert_eq!(db.resolve_owned(Owned::Session, "globex", "agent").unwrap(), ["ggs01"]);
    db.act_for(None);
    assert!(
        db.find_sandboxes("web").unwrap().is_empty(),
        "the administrator names in full"
    );
    // resolve_owned: exact id, name, label, prefix; among the tenant's own.
    assert_eq!(db.resolve_owned(Owned::Sandbox, "acme", "a-box").unwrap(), ["aaa111"]);
    assert_eq!(db.resolve_owned(Owned::Sandbox, "acme", "aaa").unwrap(), ["aaa111"]);
    assert!(db.resolve_owned(Owned::Sandbox, "acme", "g-box").unwrap().is_empty());
    assert_eq!(db.resolve_owned(Owned::Snapshot, "acme", "base").unwrap(), ["aaaa5555"]);
    assert!(
        db.resolve_owned(Owned::Snapshot, "acme", "aaa").unwrap().is_empty(),
        "snapshot prefixes are 4+"
    );
    assert_eq!(db.resolve_owned(Owned::Run, "acme", "aaar").unwrap(), ["aaar01"]);
    assert!(db.resolve_owned(Owned::Run, "globex", "aaar").unwrap().is_empty());
    assert_eq!(
        db.resolve_owned(Owned::Image, "acme", "acme-img").unwrap(),
        ["acme-img"]
    );
    assert!(
        db.resolve_owned(Owned::Image, "acme", "acme").unwrap().is_empty(),
        "images by exact name only"
    );
    let mut owned: Vec<String> = db.owned(Owned::Sandbox, "globex").unwrap().into_iter().collect();
    owned.sort();
    assert_eq!(owned, ["aaa222", "ggg333"]);
    assert!(db.owns(Owned::Session, "acme", "aaas01").unwrap());
    assert!(!db.owns(Owned::Session, "globex", "aaas01").unwrap());
    // E2B templates: a tenant sees its own and the administrator's.
    db.start_e2b_template_build("admin-tpl", "tpl-admin", "b-admin", &["default".into()], 1)
        .unwrap();
    db.start_e2b_template_build("acme-taken", "tpl-taken", "b-taken", &["default".into()], 1)
        .unwrap();
    db.act_for(Some("acme".into()));
    // A tenant's names are its own: "tpl" is stored as "acme-tpl", and
    // "admin-tpl" as "acme-admin-tpl", beside the administrator's.
    let t = db
        .start_e2b_template_build("tpl", "tpl-acme", "b-acme", &["default".into()], 1)
        .unwrap();
    assert_eq!(t.name, "acme-tpl");
    let t = db
        .start_e2b_template_build("admin-tpl", "tpl-acme2", "b-acme2", &["default".into()], 1)
        .unwrap();
    assert_eq!((t.name.as_str(), t.tenant.as_deref()), ("acme-admin-tpl", Some("acme")));
    assert_eq!(
        db.e2b_template("admin-tpl").unwrap().unwrap().id,
        "tpl-acme2",
        "its own first"
    );
    assert_eq!(db.e2b_template("tpl").unwrap().unwrap().id, "tpl-acme");
    assert!(
        matches!(
            db.start_e2b_template_build("taken", "tpl-x", "b-x", &["default".into()], 1),
            Err(StateError::NameOfAnother(_))
        ),
        "a name in its namespace that the administrator holds is not the tenant's"
    );
    db.act_for(Some("globex".into()));
    assert!(db.e2b_template("acme-tpl").unwrap().is_none());
    assert!(db.e2b_template("tpl-acme").unwrap().is_none());
    assert!(db.e2b_template("tpl").unwrap().is_none());
    assert_eq!(db.e2b_template("admin-tpl").unwrap().unwrap().tenant, None);
    let names: Vec<String> = db.e2b_templates().unwrap().into_iter().map(|t| t.name).collect();
    assert_eq!(names, ["acme-taken", "admin-tpl"]);
    db.act_for(None);
    assert_eq!(db.e2b_templates().unwrap().len(), 4);
    assert_eq!(
        db.e2b_template("acme-tpl").unwrap().unwrap().tenant.as_deref(),
        Some("acme")
    );
    assert_eq!(db.e2b_template("admin-tpl").unwrap().unwrap().id, "tpl-admin");
}

fn tenant_limits_hold_against_creates_racing_for_the_last_slot(store: &Store) {
    let db = store.open();
    db.insert_tenant(&tenant("small", Some(3), Some(5 << 30))).unwrap();
    // Eight connections race for its three slots.
    let barrier = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let mut db = store.open();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                db.act_for(Some("small".into()));
                barrier.wait();
                db.insert_sandbox(&sandbox(&format!("sb{i:04}"), &format!("box-{i}")))
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let made = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(made, 3, "{results:?}");
    for r in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            matches!(r, StateError::TenantLimit { tenant, what } if tenant == "small" && what.contains("3 sandboxes")),
            "{r}"
        );
    }
    assert_eq!(db.tenant_usage("small").unwrap().sandboxes, 3);
    assert_eq!(
        db.owned(Owned::Sandbox, "small").unwrap().len(),
        3,
        "a refused create left no row"
    );
    // A raised limit lets the next one in; a lowered one takes none away.
    let mut raised = db.tenant("small").unwrap().unwrap();
    raised.max_sandboxes = Some(4);
    assert!(db.set_tenant_limits(&raised).unwrap());
    let mut as_small = store.open();
    as_small.act_for(Some("small".into()));
    as_small.insert_sandbox(&sandbox("sb0100", "box-100")).unwrap();
    raised.max_sandboxes = Some(1);
    assert!(db.set_tenant_limits(&raised).unwrap());
    assert_eq!(db.tenant_usage("small").unwrap().sandboxes, 4);
    assert!(as_small.insert_sandbox(&sandbox("sb0101", "box-101")).is_err());
    assert_eq!(db.tenant("small").unwrap().unwrap().max_sandboxes, Some(1));
    assert!(!db.set_tenant_limits(&tenant("nobody", None, None)).unwrap());
    // Memory: 3 GiB held of 5; another 1 GiB sandbox would be a fourth.
    let mut db = store.open();
    db.insert_tenant(&tenant("mem", None, Some(2 << 30))).unwrap();
    db.act_for(Some("mem".into()));
    db.insert_sandbox(&sandbox("m1", "m-1")).unwrap();
    db.insert_sandbox(&sandbox("m2", "m-2")).unwrap();
    let err = db.insert_sandbox(&sandbox("m3", "m-3")).unwrap_err();
    assert!(err.to_string().contains("2 GiB of memory"), "{err}");
    // An exited sandbox holds no memory, but still counts for its disk.
    db.act_for(None);
    db.transition("m1", SandboxState::Creating, SandboxState::Exited, None)
        .unwrap();
    db.act_for(Some("mem".into()));
    db.insert_sandbox(&sandbox("m3", "m-3")).unwrap();
    // A tenant with a disk limit needs sandboxes with one.
    db.act_for(None);
    db.insert_tenant(&TenantRecord {
        max_disk: Some(100 << 20),
        ..tenant("disk", None, None)
    })
    .unwrap();
    db.act_for(Some("disk".into()));
    db.insert_sandbox(&sandbox("d1", "d-1")).unwrap();
    let err = db.insert_sandbox(&sandbox("d2", "d-2")).unwrap_err();
    assert!(err.to_string().contains("100 MiB of disk"), "{err}");
    let unbounded = SandboxRecord {
        disk_bytes: None,
        ..sandbox("d3", "d-3")
    };
    let err = db.insert_sandbox(&unbounded).unwrap_err();
    assert!(err.to_string().contains("no disk limit of its own"), "{err}");
    // The administrator has no limits.
    db.act_for(None);
    db.insert_sandbox(&sandbox("admin1", "admin-1")).unwrap();
    // A connection acting for a tenant that is gone makes nothing.
    db.act_for(Some("nobody".into()));
    assert!(matches!(
        db.insert_sandbox(&sandbox("x1", "x-1")),
        Err(StateError::TenantGone(t)) if t == "nobody"
    ));
}

fn removing_a_tenant_ends_its_tokens_and_leaves_nothing_without_an_owner(store: &Store) {
    let mut db = store.open();
    db.insert_tenant(&tenant("acme", None, None)).unwrap();
    let token = |id: &str, tenant: Option<&str>| TokenRecord {
        id: id.into(),
        name: id.into(),
        created_at: 1,
        last_used: None,
        tenant: tenant.map(Into::into),
    };
    db.insert_token(&token("ta", Some("acme")), "hash-a").unwrap();
    db.insert_token(&token("tadmin", None), "hash-admin").unwrap();
    assert!(
        db.insert_token(&token("tx", Some("nobody")), "hash-x").is_err(),
        "a token of a tenant that does not exist is refused"
    );
    assert_eq!(
        db.use_token("hash-a", 5).unwrap().unwrap().tenant.as_deref(),
        Some("acme")
    );
    db.act_for(Some("acme".into()));
    db.insert_snapshot(&snapshot("aaaa5555", None, "gone", None, 1))
        .unwrap();
    db.insert_run(&run("aaar01", 1)).unwrap();
    db.act_for(None);
    assert!(db.delete_tenant("acme").unwrap());
    assert!(!db.delete_tenant("acme").unwrap(), "once");
    assert!(db.use_token("hash-a", 6).unwrap().is_none(), "its token is gone");
    assert!(db.use_token("hash-admin", 6).unwrap().is_some());
    assert_eq!(
        db.tenant_of(Owned::Snapshot, "aaaa5555").unwrap(),
        None,
        "the administrator's now"
    );
    assert_eq!(db.tenant_of(Owned::Run, "aaar01").unwrap(), None);
    assert!(db.tenants().unwrap().is_empty());
}

fn audit_rows_are_kept_in_order_per_tenant_and_pruned_by_age(store: &Store) {
    let db = store.open();
    let row = |at: i64, tenant: Option<&str>, path: &str| AuditEntry {
        at,
        token: Some("t1".into()),
        tenant: tenant.map(Into::into),
        surface: "api".into(),
        method: "GET".into(),
        path: path.into(),
        status: 200,
    };
    db.insert_audit(&[
        row(1, None, "/a"),
        row(2, Some("acme"), "/b"),
        row(3, Some("globex"), "/c"),
    ])
    .unwrap();
    db.insert_audit(&[row(4, Some("acme"), "/d")]).unwrap();
    // A batch past one statement's rows.
    let many: Vec<AuditEntry> = (0..150)
        .map(|i| row(100 + i, Some("many"), &format!("/m{i}")))
        .collect();
    db.insert_audit(&many).unwrap();
    let back = db.audit(Some("many"), 1000).unwrap();
    assert_eq!(back, many, "every row, in order");
    let all: Vec<String> = db
        .audit(None, 1000)
        .unwrap()
        .into_iter()
        .map(|r| r.path)
        .take(4)
        .collect();
    assert_eq!(all, ["/a", "/b", "/c", "/d"], "oldest first");
    let acme: Vec<String> = db
        .audit(Some("acme"), 100)
        .unwrap()
        .into_iter()
        .map(|r| r.path)
        .collect();
    assert_eq!(acme, ["/b", "/d"]);
    let newest: Vec<String> = db.audit(None, 2).unwrap().into_iter().map(|r| r.path).collect();
    assert_eq!(newest, ["/m148", "/m149"], "the newest N");
    assert_eq!(db.audit(Some("acme"), 1).unwrap()[0], row(4, Some("acme"), "/d"));
    db.with(|b| Ok(b.execute("DELETE FROM audit WHERE at < $1", &[Value::Int(3)])?))
        .unwrap();
    assert_eq!(db.audit(None, 1000).unwrap().len(), 152);
}

fn rows_without_a_home_are_adopted_by_the_next_open(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "old")).unwrap();
    // As written before sandboxes named their home.
    db.with(|b| Ok(b.execute("UPDATE sandboxes SET home_id = '' WHERE id = 'abc123'", &[])?))
        .unwrap();
    assert!(db.sandboxes().unwrap().is_empty());
    db.insert_sandbox(&sandbox("def456", "new")).unwrap();
    drop(db);
    let db = store.open();
    let names: Vec<String> = db.sandboxes().unwrap().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["old", "new"], "the row without a home was not adopted");
    // Nothing is left to adopt, so the next open writes nothing.
    let left = db
        .with(|b| Ok(b.query("SELECT id FROM sandboxes WHERE home_id = ''", &[])?))
        .unwrap();
    assert!(left.is_empty());
    assert_eq!(store.open().sandboxes().unwrap().len(), 2);
}

fn a_job_is_claimed_by_one_worker_at_a_time_and_a_stale_claim_commits_nothing(store: &Store) {
    use cairn_state::queue::Fence;
    use std::time::Duration;
    let db = store.open();
    db.insert_run(&run("run111", 1)).unwrap();
    db.enqueue_run("run111").unwrap();
    let first = db
        .claim_job("w1", Duration::from_millis(300), &["run"])
        .unwrap()
        .expect("the queued run");
    assert_eq!((first.epoch, first.status.as_str()), (1, "claimed"));
    assert!(first.lease_left_ms.unwrap() > 0);
    // Held: nobody else gets it, and it renews.
    assert!(db.claim_job("w2", Duration::from_secs(30), &["run"]).unwrap().is_none());
    let f1 = Fence {
        job: "run111".into(),
        epoch: 1,
    };
    assert!(db.renew_lease(&f1, "w1", Duration::from_millis(300)).unwrap());
    // A branch job is not a run job.
    assert!(db
        .claim_job("w2", Duration::from_secs(30), &["branch"])
        .unwrap()
        .is_none());
    // Under its claim, w1 commits.
    let mut w1 = store.open();
    w1.set_fence(Some(f1.clone()));
    w1.put_stage(&stage("run111", "a", "", "running"), Some(("forked", "by w1", None)))
        .unwrap();
    // The lease runs out (no heartbeat): the reaper returns it, and w2 claims it.
    std::thread::sleep(Duration::from_millis(400));
    let reaped = db.reap_expired().unwrap();
    assert_eq!(reaped.len(), 1);
    assert!(db
        .events_of("run111")
        .unwrap()
        .iter()
        .any(|e| e.kind == "lease-expired"));
    let second = db
        .claim_job("w2", Duration::from_secs(30), &["run"])
        .unwrap()
        .expect("the expired job");
    assert_eq!((second.epoch, second.worker.as_deref()), (2, Some("w2")));
    // w1 wakes: its renewal and every commit are refused, and nothing is written.
    assert!(!w1.renew_lease(&f1, "w1", Duration::from_secs(30)).unwrap());
    let before = db.events_of("run111").unwrap().len();
    let err = w1
        .put_stage(
            &stage("run111", "a", "", "completed"),
            Some(("completed", "by w1", None)),
        )
        .unwrap_err();
    assert!(matches!(err, StateError::Fenced { .. }), "{err}");
    assert!(err.to_string().contains("another worker"), "{err}");
    assert!(matches!(
        w1.add_checkpoint("run111", "a", "", "snap", 5),
        Err(StateError::Fenced { .. })
    ));
    assert!(matches!(
        w1.finish_run("run111", "completed", None, 5),
        Err(StateError::Fenced { .. })
    ));
    assert_eq!(db.events_of("run111").unwrap().len(), before);
    assert_eq!(db.stage("run111", "a", "").unwrap().unwrap().status, "running");
    assert!(!w1.finish_job(&f1).unwrap());
    // w2's claim commits and ends the job.
    let w2 = store.open();
    let f2 = Fence {
        job: "run111".into(),
        epoch: 2,
    };
    w2.set_fence(Some(f2.clone()));
    w2.finish_run("run111", "completed", None, 6).unwrap();
    assert!(w2.finish_job(&f2).unwrap());
    assert_eq!(db.job("run111").unwrap().unwrap().status, "done");
    assert!(db
        .claim_job("w3", Duration::from_secs(30), &["run", "branch"])
        .unwrap()
        .is_none());
    // Queued again (a resume), it is claimable again under a new epoch.
    db.enqueue_run("run111").unwrap();
    let again = db.claim_job("w3", Duration::from_secs(30), &["run"]).unwrap().unwrap();
    assert_eq!(again.epoch, 3);
}

fn orphans_are_sandboxes_whose_claim_moved_on_that_no_stage_row_names(store: &Store) {
    use cairn_state::queue::Fence;
    let mut db = store.open();
    db.insert_run(&run("run444", 1)).unwrap();
    db.enqueue_run("run444").unwrap();
    let first = db
        .claim_job("w1", Duration::from_millis(50), &["run"])
        .unwrap()
        .unwrap();
    let f1 = Fence {
        job: first.id.clone(),
        epoch: first.epoch,
    };
    for id in ["aaa111", "bbb222", "ccc333"] {
        db.insert_sandbox(&sandbox(id, id)).unwrap();
        db.record_claimed_sandbox(id, &f1, "run444", "a", "").unwrap();
    }
    // A sandbox made outside any claim (a user's) is never an orphan.
    db.insert_sandbox(&sandbox("ddd444", "users")).unwrap();
    // While the claim is held, nothing is an orphan.
    assert!(db.orphans().unwrap().is_empty());
    // A stage row names bbb222: a resume would re-attach to it.
    let mut named = stage("run444", "a", "", "running");
    named.sandbox_id = Some("bbb222".into());
    db.put_stage(&named, None).unwrap();
    // The lease runs out and w2 takes the job over (claim 2).
    std::thread::sleep(Duration::from_millis(100));
    let second = db.claim_job("w2", Duration::from_secs(30), &["run"]).unwrap().unwrap();
    assert_eq!(second.epoch, 2);
    let ids = |db: &Db| -> Vec<String> { db.orphans().unwrap().into_iter().map(|o| o.sandbox_id).collect() };
    assert_eq!(ids(&db), ["aaa111", "ccc333"]);
    let orphan = &db.orphans().unwrap()[0];
    assert_eq!(
        (orphan.epoch, orphan.run_id.as_str(), orphan.stage.as_str()),
        (1, "run444", "a")
    );
    assert!(
        orphan.reason.contains("claim 2") && orphan.reason.contains("w2"),
        "{}",
        orphan.reason
    );
    // w2's own sandbox, under the claim it holds, is not one.
    let f2 = Fence {
        job: first.id.clone(),
        epoch: 2,
    };
    db.insert_sandbox(&sandbox("eee555", "eee555")).unwrap();
    db.record_claimed_sandbox("eee555", &f2, "run444", "a", "").unwrap();
    assert_eq!(ids(&db), ["aaa111", "ccc333"]);
    // A sandbox's claim goes with it.
    db.delete_sandbox("aaa111").unwrap();
    assert_eq!(ids(&db), ["ccc333"]);
    // Once the job ends, what no stage row names is left over, its own too.
    assert!(db.finish_job(&f2).unwrap());
    let orphans = db.orphans().unwrap();
    assert_eq!(
        orphans.iter().map(|o| o.sandbox_id.as_str()).collect::<Vec<_>>(),
        ["ccc333", "eee555"]
    );
    assert!(orphans.iter().all(|o| o.reason.contains("ended")), "{orphans:?}");
}

fn an_expired_claim_taken_over_before_the_reaper_records_its_expiry(store: &Store) {
    use std::time::Duration;
    let db = store.open();
    db.insert_run(&run("run333", 1)).unwrap();
    db.enqueue_run("run333").unwrap();
    let first = db
        .claim_job("w1", Duration::from_millis(50), &["run"])
        .unwrap()
        .unwrap();
    assert_eq!(first.epoch, 1);
    assert!(db.claim_job("w2", Duration::from_secs(30), &["run"]).unwrap().is_none());
    // The lease runs out and no reaper runs: w2's claim takes it over and
    // records the expiry in the same transaction.
    std::thread::sleep(Duration::from_millis(100));
    let second = db
        .claim_job("w2", Duration::from_secs(30), &["run"])
        .unwrap()
        .expect("the expired job");
    assert_eq!((second.epoch, second.worker.as_deref()), (2, Some("w2")));
    let expired: Vec<String> = db
        .events_of("run333")
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "lease-expired")
        .map(|e| e.detail)
        .collect();
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert!(
        expired[0].contains("worker w1")
            && expired[0].contains("claim 1")
            && expired[0].contains("taken over by worker w2"),
        "{expired:?}"
    );
    // Nothing left for the reaper to record twice.
    assert!(db.reap_expired().unwrap().is_empty());
}

fn concurrent_claims_take_each_job_once(store: &Store) {
    use std::time::Duration;
    let db = store.open();
    db.insert_run(&run("run222", 1)).unwrap();
    for i in 0..12 {
        db.enqueue_branch("run222", "fit", &format!("b{i}"), "{}").unwrap();
    }
    let claimed: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|w| {
                s.spawn(move || {
                    let db = store.open();
                    let mut mine = Vec::new();
                    while let Some(j) = db
                        .claim_job(&format!("w{w}"), Duration::from_secs(30), &["branch"])
                        .unwrap()
                    {
                        mine.push(j.id);
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut sorted = claimed.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 12, "{claimed:?}");
    assert_eq!(claimed.len(), 12, "a job was claimed twice: {claimed:?}");
}

fn sandboxes_are_listed_and_found_only_on_their_home(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "mine")).unwrap();
    assert_eq!(db.sandboxes().unwrap().len(), 1);
    // Another home on the same state store (a second host) sees none of them.
    let other = tempfile::tempdir().unwrap();
    let mut home = Home::at(other.path());
    if let Some(d) = &store.db {
        home = home.with_state(&d.url).with_store("s3://shared/prefix");
        // The owner names the shared store first.
        drop(
            Db::open_home(
                &Home::at(store.dir.path())
                    .with_state(&d.url)
                    .with_store("s3://shared/prefix"),
            )
            .unwrap(),
        );
    } else {
        home = home.with_state(format!("sqlite:{}", store.dir.path().join("state.db").display()));
    }
    let theirs = Db::open_home(&home).unwrap();
    assert!(theirs.sandboxes().unwrap().is_empty());
    assert!(theirs.find_sandboxes("mine").unwrap().is_empty());
    assert!(theirs.find_sandboxes("abc").unwrap().is_empty());
    assert_eq!(db.find_sandboxes("mine").unwrap().len(), 1);
}

fn a_snapshot_is_marked_durable_in_the_remote_store_once(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    db.insert_snapshot(&snapshot("aaaa1111", None, "abc123", None, 1))
        .unwrap();
    db.insert_snapshot(&snapshot("aaaa2222", Some("aaaa1111"), "abc123", None, 2))
        .unwrap();
    let both: std::collections::HashSet<String> = ["aaaa1111".to_string(), "aaaa2222".to_string()].into();
    assert_eq!(db.snapshots_not_remote_durable().unwrap(), both);
    assert_eq!(db.snapshot_remote_durable_at("aaaa1111").unwrap(), None);

    db.mark_snapshot_remote_durable("aaaa1111", 1_700_000_000_123).unwrap();
    // A second mark keeps the first time.
    db.mark_snapshot_remote_durable("aaaa1111", 1_800_000_000_000).unwrap();
    assert_eq!(
        db.snapshot_remote_durable_at("aaaa1111").unwrap(),
        Some(1_700_000_000_123)
    );
    assert_eq!(
        db.snapshots_not_remote_durable().unwrap(),
        ["aaaa2222".to_string()].into()
    );
    assert_eq!(db.snapshot_remote_durable_at("no-such").unwrap(), None);
}

fn sandbox(id: &str, name: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        name: name.into(),
        image: "busybox".into(),
        driver: "native".into(),
        state: SandboxState::Creating,
        pid: None,
        pid_start: None,
        owner_pid: 1,
        owner_start: 1,
        memory_bytes: 1 << 30,
        cpu_millis: 1000,
        pids_max: 100,
        disk_bytes: Some(64 << 20),
        created_at: 5,
        auto_remove: false,
        ended_reason: None,
        layers: vec!["b".into(), "a".into(), "c".into()],
        services: vec!["sleep 1".into(), "httpd".into()],
        last_snapshot: None,
        network: None,
        oom_kills: 0,
    }
}

fn snapshot(id: &str, parent: Option<&str>, sandbox: &str, label: Option<&str>, at: i64) -> SnapshotRecord {
    SnapshotRecord {
        id: id.into(),
        parent_id: parent.map(Into::into),
        sandbox_id: sandbox.into(),
        image: "busybox".into(),
        driver: "native".into(),
        label: label.map(Into::into),
        created_at: at,
        new_bytes: 10,
        stored_bytes: u64::MAX / 2,
        layers: vec![format!("{id}-top"), "base".into()],
    }
}

fn run(id: &str, at: i64) -> RunRecord {
    RunRecord {
        id: id.into(),
        pipeline: "p".into(),
        file: "p.toml".into(),
        spec: "[pipeline]".into(),
        params: "k=v".into(),
        status: "running".into(),
        created_at: at,
        ended_at: None,
        error: None,
    }
}

fn stage(run: &str, name: &str, branch: &str, status: &str) -> StageRecord {
    StageRecord {
        run_id: run.into(),
        stage: name.into(),
        branch: branch.into(),
        stage_key: format!("{name}{branch}-v1"),
        status: status.into(),
        attempts: 1,
        input_snapshot: Some("in".into()),
        output_snapshot: None,
        sandbox_id: Some("sb".into()),
        started_at: Some(100),
        ended_at: None,
        error: None,
        metric: None,
    }
}

fn sandboxes_round_trip_with_every_field_and_their_layers_in_order(store: &Store) {
    let mut db = store.open();
    let mut rec = sandbox("abc123", "one");
    rec.pid_start = Some(u64::MAX - 1);
    rec.owner_start = 1 << 40;
    rec.auto_remove = true;
    rec.last_snapshot = Some("snap".into());
    let policy = cairn_sandbox::net::NetPolicy::parse(None, &["pypi.org:443".into()], &["8080:80".into()]).unwrap();
    rec.network = cairn_state::network::SandboxNetwork::of(&policy);
    db.insert_sandbox(&rec).unwrap();
    db.insert_sandbox(&sandbox("abd456", "two")).unwrap();
    assert_eq!(db.find_sandboxes("abd456").unwrap()[0].network, None);
    let got = db.find_sandboxes("one").unwrap();
    assert_eq!(got.len(), 1);
    let got = &got[0];
    assert_eq!(got.id, "abc123");
    assert_eq!(got.layers, vec!["b", "a", "c"]);
    assert_eq!(got.services, vec!["sleep 1", "httpd"]);
    assert_eq!(got.pid_start, Some(u64::MAX - 1));
    assert_eq!(got.owner_start, 1 << 40);
    assert_eq!(got.memory_bytes, 1 << 30);
    assert_eq!(got.disk_bytes, Some(64 << 20));
    assert!(got.auto_remove);
    assert_eq!(got.state, SandboxState::Creating);
    assert_eq!(got.last_snapshot.as_deref(), Some("snap"));
    assert_eq!(got.network, rec.network);
    let mut held = rec.network.clone().unwrap();
    held.held = Some(cairn_state::network::Held {
        slot: 7,
        interface: "cn-7".into(),
        address: "10.213.0.30".parse().unwrap(),
        gateway: "10.213.0.29".parse().unwrap(),
        mac: "02:00:00:00:00:01".into(),
        resolved: vec![("pypi.org".into(), vec!["1.2.3.4".parse().unwrap()])],
    });
    db.set_network("abc123", Some(&held)).unwrap();
    assert_eq!(db.find_sandboxes("abc123").unwrap()[0].network.as_ref(), Some(&held));
    // Prefixes of at least three characters match; an exact id wins.
    assert_eq!(db.find_sandboxes("ab").unwrap().len(), 0);
    assert_eq!(db.find_sandboxes("abc").unwrap().len(), 1);
    assert_eq!(db.find_sandboxes("ab_").unwrap().len(), 0, "no LIKE wildcards");
    assert_eq!(db.find_sandboxes("abc123").unwrap()[0].name, "one");
    let all: Vec<String> = db.sandboxes().unwrap().into_iter().map(|s| s.id).collect();
    assert_eq!(all, vec!["abc123", "abd456"]);
    db.set_sandbox_layers("abc123", &["z".into()], &[], Some("other"))
        .unwrap();
    let got = &db.find_sandboxes("abc123").unwrap()[0];
    assert_eq!(got.layers, vec!["z"]);
    assert!(got.services.is_empty());
    assert_eq!(got.last_snapshot.as_deref(), Some("other"));
    db.delete_sandbox("abc123").unwrap();
    assert!(db.find_sandboxes("abc123").unwrap().is_empty());
}

fn a_taken_name_is_refused_and_leaves_the_store_usable(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    let err = db.insert_sandbox(&sandbox("def456", "one")).unwrap_err();
    assert!(matches!(err, StateError::NameTaken(ref n) if n == "one"), "{err}");
    assert!(err.to_string().contains("cairn rm -f one"), "{err}");
    // Nothing of the refused sandbox stayed, and the next write works.
    assert!(db.find_sandboxes("def456").unwrap().is_empty());
    db.insert_sandbox(&sandbox("def456", "two")).unwrap();
    assert_eq!(db.find_sandboxes("def456").unwrap()[0].layers.len(), 3);
    // A duplicate id is an error too, but not a taken name.
    let err = db.insert_sandbox(&sandbox("def456", "three")).unwrap_err();
    assert!(!matches!(err, StateError::NameTaken(_)), "{err}");
}

fn invalid_transitions_name_both_states_and_lost_races_conflict(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    let err = db
        .transition("abc123", SandboxState::Exited, SandboxState::Running, None)
        .unwrap_err();
    assert_eq!(err.to_string(), "sandbox abc123 cannot go from exited to running");
    let err = db
        .transition("abc123", SandboxState::Running, SandboxState::Exited, None)
        .unwrap_err();
    assert!(matches!(err, StateError::Conflict(_)), "{err}");
    db.set_running("abc123", 10, 20).unwrap();
    assert!(matches!(db.set_running("abc123", 11, 21), Err(StateError::Conflict(_))));
    let got = &db.find_sandboxes("abc123").unwrap()[0];
    assert_eq!(
        (got.state, got.pid, got.pid_start),
        (SandboxState::Running, Some(10), Some(20))
    );
    db.set_process("abc123", 12, 22).unwrap();
    db.transition("abc123", SandboxState::Running, SandboxState::Exited, Some("killed"))
        .unwrap();
    // No reason keeps the recorded one.
    db.transition("abc123", SandboxState::Exited, SandboxState::Removing, None)
        .unwrap();
    let got = &db.find_sandboxes("abc123").unwrap()[0];
    assert_eq!(got.state, SandboxState::Removing);
    assert_eq!(got.pid, Some(12));
    assert_eq!(got.ended_reason.as_deref(), Some("killed"));
    assert!(matches!(
        db.transition("nope", SandboxState::Creating, SandboxState::Running, None),
        Err(StateError::Conflict(_))
    ));
}

fn owners_change_only_by_compare_and_set(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    assert!(!db.take_over("abc123", (2, 2), (3, 3)).unwrap());
    assert!(db.take_over("abc123", (1, 1), (3, u64::MAX)).unwrap());
    assert!(!db.take_over("abc123", (1, 1), (4, 4)).unwrap());
    let got = &db.find_sandboxes("abc123").unwrap()[0];
    assert_eq!((got.owner_pid, got.owner_start), (3, u64::MAX));
    db.set_owner("abc123", 5, 6).unwrap();
    assert!(db.take_over("abc123", (5, 6), (7, 8)).unwrap());
}

fn of_concurrent_transitions_from_several_connections_exactly_one_wins(store: &Store) {
    const ROUNDS: usize = 10;
    const RACERS: usize = 4;
    let mut setup = store.open();
    for i in 0..ROUNDS {
        setup
            .insert_sandbox(&sandbox(&format!("race{i:03}"), &format!("r{i}")))
            .unwrap();
    }
    let conns: Vec<Db> = (0..RACERS).map(|_| store.open()).collect();
    let barrier = Arc::new(Barrier::new(RACERS));
    let wins: Vec<Vec<bool>> = std::thread::scope(|s| {
        let handles: Vec<_> = conns
            .iter()
            .map(|db| {
                let barrier = barrier.clone();
                s.spawn(move || {
                    (0..ROUNDS)
                        .map(|i| {
                            barrier.wait();
                            match db.transition(
                                &format!("race{i:03}"),
                                SandboxState::Creating,
                                SandboxState::Exited,
                                None,
                            ) {
                                Ok(()) => true,
                                Err(StateError::Conflict(_)) => false,
                                Err(e) => panic!("a racing transition failed: {e}"),
                            }
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for i in 0..ROUNDS {
        let winners = wins.iter().filter(|w| w[i]).count();
        assert_eq!(winners, 1, "round {i}: {winners} connections won the same transition");
    }
}

fn a_transition_waits_for_a_concurrent_transaction_then_conflicts(store: &Store) {
    let mut a = store.open();
    let b = store.open();
    a.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    let (moved, go) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let racer = s.spawn(move || {
            go.recv().unwrap();
            b.transition("abc123", SandboxState::Creating, SandboxState::Removing, None)
        });
        a.transaction(|tx| {
            let n = tx.execute(
                "UPDATE sandboxes SET state = 'exited' WHERE id = $1 AND state = 'creating'",
                &[Value::from("abc123")],
            )?;
            assert_eq!(n, 1);
            moved.send(()).unwrap();
            // The other connection's compare-and-set must wait for this
            // commit, then see that the sandbox is no longer creating.
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        })
        .unwrap();
        let err = racer.join().unwrap().unwrap_err();
        assert!(matches!(err, StateError::Conflict(_)), "{err}");
    });
    assert_eq!(a.find_sandboxes("abc123").unwrap()[0].state, SandboxState::Exited);
}

fn images_are_replaced_whole_and_keep_layer_order(store: &Store) {
    let mut db = store.open();
    let mut img = ImageRecord {
        name: "img".into(),
        source: "test".into(),
        size_bytes: 1 << 33,
        created_at: 7,
        layers: vec!["top".into(), "mid".into(), "base".into()],
        config: None,
    };
    db.put_image(&img).unwrap();
    let got = db.image("img").unwrap().unwrap();
    assert_eq!(got.layers, vec!["top", "mid", "base"]);
    assert_eq!(got.size_bytes, 1 << 33);
    assert_eq!(got.config, None);
    assert_eq!(db.image_config("img").unwrap(), None);
    img.layers = vec!["new".into()];
    img.source = "rebuilt".into();
    let config = cairn_state::ImageConfig {
        env: [("MODE".to_string(), "prod".to_string())].into(),
        workdir: Some("/srv".into()),
        user: Some("user".into()),
        start_cmd: Some("httpd".into()),
        ready_cmd: None,
    };
    img.config = Some(config.clone());
    db.put_image(&img).unwrap();
    let got = db.image("img").unwrap().unwrap();
    assert_eq!(
        (got.source.as_str(), got.layers.clone(), got.config),
        ("rebuilt", vec!["new".to_string()], Some(config.clone()))
    );
    assert_eq!(
        db.image_config("img").unwrap(),
        Some(config),
        "a rebuilt image's config replaces none"
    );
    assert_eq!(db.image_config("no-such-image").unwrap(), None);
    img.config = None;
    img.name = "another".into();
    db.put_image(&img).unwrap();
    let names: Vec<String> = db.images().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, vec!["another", "img"]);
    assert!(db.delete_image("img").unwrap());
    assert!(!db.delete_image("img").unwrap());
    assert!(db.image("img").unwrap().is_none());
}

fn layers_stay_referenced_while_an_image_sandbox_or_snapshot_names_them(store: &Store) {
    let mut db = store.open();
    db.put_image(&ImageRecord {
        name: "img".into(),
        source: "test".into(),
        size_bytes: 1,
        created_at: 0,
        layers: vec!["a".into()],
        config: None,
    })
    .unwrap();
    db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    db.insert_snapshot(&snapshot("s1", None, "abc123", None, 1)).unwrap();
    assert!(db.delete_image("img").unwrap());
    let refs = db.referenced_layers().unwrap();
    assert!(
        refs.contains("a") && refs.contains("s1-top") && refs.contains("base"),
        "{refs:?}"
    );
    db.delete_sandbox("abc123").unwrap();
    db.delete_snapshot("s1").unwrap();
    assert!(db.referenced_layers().unwrap().is_empty());
}

fn snapshots_keep_parents_labels_and_layers(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    db.insert_snapshot(&snapshot("aaaa1111", None, "abc123", Some("base"), 1))
        .unwrap();
    db.insert_snapshot(&snapshot("aaaa2222", Some("aaaa1111"), "abc123", None, 2))
        .unwrap();
    db.insert_snapshot(&snapshot("bbbb3333", Some("aaaa2222"), "gone", Some("tip"), 3))
        .unwrap();
    assert_eq!(
        db.find_sandboxes("abc123").unwrap()[0].last_snapshot.as_deref(),
        Some("aaaa2222")
    );
    let all = db.snapshots().unwrap();
    let lineage: Vec<(String, Option<String>)> = all.iter().map(|s| (s.id.clone(), s.parent_id.clone())).collect();
    assert_eq!(
        lineage,
        vec![
            ("aaaa1111".into(), None),
            ("aaaa2222".into(), Some("aaaa1111".into())),
            ("bbbb3333".into(), Some("aaaa2222".into()))
        ]
    );
    assert_eq!(all[2].layers, vec!["bbbb3333-top", "base"]);
    assert_eq!(all[2].stored_bytes, u64::MAX / 2);
    // By label, by a prefix of at least four characters, newest first.
    assert_eq!(db.find_snapshots("tip").unwrap()[0].id, "bbbb3333");
    assert_eq!(db.find_snapshots("base").unwrap()[0].id, "aaaa1111");
    let by_prefix: Vec<String> = db.find_snapshots("aaaa").unwrap().into_iter().map(|s| s.id).collect();
    assert_eq!(by_prefix, vec!["aaaa2222", "aaaa1111"]);
    assert!(db.find_snapshots("aaa").unwrap().is_empty());
    // Recording the same snapshot again keeps one row.
    db.insert_snapshot(&snapshot("aaaa1111", None, "abc123", Some("base"), 1))
        .unwrap();
    assert_eq!(db.snapshots().unwrap().len(), 3);
    assert_eq!(db.find_snapshots("aaaa1111").unwrap()[0].layers.len(), 2);
    db.delete_snapshot("aaaa1111").unwrap();
    let left = db.find_snapshots("aaaa2222").unwrap();
    assert_eq!(
        left[0].parent_id.as_deref(),
        Some("aaaa1111"),
        "children keep their lineage"
    );
    assert_eq!(left[0].layers.len(), 2);
}

fn runs_are_found_by_prefix_finished_and_deleted_with_everything(store: &Store) {
    let mut db = store.open();
    db.insert_run(&run("run111", 1)).unwrap();
    db.insert_run(&run("run222", 2)).unwrap();
    db.insert_run(&run("xyz333", 3)).unwrap();
    assert_eq!(db.find_runs("run").unwrap().len(), 2);
    assert_eq!(db.find_runs("ru").unwrap().len(), 0);
    assert_eq!(db.find_runs("xyz333").unwrap()[0].params, "k=v");
    db.finish_run("run111", "failed", Some("stage a died"), 50).unwrap();
    let got = &db.find_runs("run111").unwrap()[0];
    assert_eq!(
        (got.status.as_str(), got.error.as_deref(), got.ended_at),
        ("failed", Some("stage a died"), Some(50))
    );
    let mut done = stage("run111", "a", "", "completed");
    done.output_snapshot = Some("out".into());
    db.put_stage(&done, Some(("completed", "ok", Some("out")))).unwrap();
    db.add_checkpoint("run111", "a", "", "cp", 3).unwrap();
    db.insert_artifact(&artifact("art1", "run111", "/o")).unwrap();
    db.insert_dead_letter(&dead_letter("dl1", "run111")).unwrap();
    db.put_stage(&stage("run222", "a", "", "running"), None).unwrap();
    db.delete_run("run111").unwrap();
    assert!(db.find_runs("run111").unwrap().is_empty());
    assert!(db.stages_of("run111").unwrap().is_empty());
    assert!(db.events_of("run111").unwrap().is_empty());
    assert!(db.artifacts(Some("run111")).unwrap().is_empty());
    assert!(db.dead_letters().unwrap().is_empty());
    assert!(db.completed_key("a-v1").unwrap().is_none());
    assert!(db.newest_checkpoint("run111", "a", "").unwrap().is_none());
    assert!(db.pipeline_snapshots().unwrap().is_empty());
    // Other runs are untouched.
    assert_eq!(db.stages_of("run222").unwrap().len(), 1);
    let ids: Vec<String> = db.runs().unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(ids, vec!["run222", "xyz333"]);
}

fn stages_upsert_and_record_the_first_completion_of_a_key(store: &Store) {
    let mut db = store.open();
    db.insert_run(&run("run111", 1)).unwrap();
    db.insert_run(&run("run222", 2)).unwrap();
    let mut s = stage("run111", "train", "", "running");
    db.put_stage(&s, Some(("started", "attempt 1", None))).unwrap();
    assert!(db.completed_key("train-v1").unwrap().is_none());
    s.attempts = 2;
    s.status = "failed".into();
    s.error = Some("exit 7".into());
    db.put_stage(&s, Some(("retry", "attempt 2", None))).unwrap();
    let got = db.stage("run111", "train", "").unwrap().unwrap();
    assert_eq!(
        (got.attempts, got.status.as_str(), got.error.as_deref()),
        (2, "failed", Some("exit 7"))
    );
    s.status = "completed".into();
    s.error = None;
    s.output_snapshot = Some("out1".into());
    s.ended_at = Some(200);
    s.metric = Some(0.25);
    db.put_stage(&s, Some(("completed", "done", Some("out1")))).unwrap();
    assert_eq!(
        db.completed_key("train-v1").unwrap(),
        Some(("out1".into(), "run111".into(), Some(0.25)))
    );
    // A later completion of the same key keeps the first.
    let mut again = s.clone();
    again.run_id = "run222".into();
    again.output_snapshot = Some("out2".into());
    db.put_stage(&again, None).unwrap();
    assert_eq!(db.completed_key("train-v1").unwrap().unwrap().0, "out1");
    // Branch stages record their keys through complete_key only.
    let mut branch = stage("run111", "search", "h1", "completed");
    branch.output_snapshot = Some("bout".into());
    branch.metric = Some(-3.5);
    db.put_stage(&branch, None).unwrap();
    assert!(db.completed_key("searchh1-v1").unwrap().is_none());
    db.complete_key(&branch, 300).unwrap();
    assert_eq!(db.completed_key("searchh1-v1").unwrap().unwrap().2, Some(-3.5));
    assert!(db.stage("run111", "search", "h2").unwrap().is_none());
    let mut late = stage("run111", "eval", "", "pending");
    late.started_at = Some(400);
    db.put_stage(&late, None).unwrap();
    let order: Vec<(String, String)> = db
        .stages_of("run111")
        .unwrap()
        .into_iter()
        .map(|s| (s.stage, s.branch))
        .collect();
    assert_eq!(
        order,
        vec![
            ("search".into(), "h1".into()),
            ("train".into(), "".into()),
            ("eval".into(), "".into())
        ]
    );
    let kinds: Vec<String> = db.events_of("run111").unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, vec!["started", "retry", "completed"]);
    assert!(db.pipeline_snapshots().unwrap().contains("out1"));
}

fn checkpoints_newest_wins_even_within_one_millisecond(store: &Store) {
    let db = store.open();
    db.add_checkpoint("r", "s", "", "cp1", 10).unwrap();
    db.add_checkpoint("r", "s", "", "cp2", 20).unwrap();
    db.add_checkpoint("r", "s", "", "cp3", 20).unwrap();
    db.add_checkpoint("r", "s", "b", "other-branch", 30).unwrap();
    assert_eq!(db.newest_checkpoint("r", "s", "").unwrap().as_deref(), Some("cp3"));
    assert_eq!(
        db.newest_checkpoint("r", "s", "b").unwrap().as_deref(),
        Some("other-branch")
    );
    assert!(db.newest_checkpoint("r", "t", "").unwrap().is_none());
    let events = db.events_of("r").unwrap();
    assert_eq!(events.len(), 4);
    assert!(events.iter().all(|e| e.kind == "checkpoint"));
    assert_eq!(events[2].snapshot_id.as_deref(), Some("cp3"));
    assert!(db.pipeline_snapshots().unwrap().contains("cp1"));
}

fn artifact(id: &str, run: &str, path: &str) -> ArtifactRecord {
    ArtifactRecord {
        id: id.into(),
        run_id: run.into(),
        stage: "a".into(),
        branch: "".into(),
        path: path.into(),
        size_bytes: 1 << 40,
        content_hash: "h".into(),
        snapshot_id: "snap".into(),
    }
}

fn artifacts_are_pending_until_their_stage_completes_under_the_claim_that_made_them(store: &Store) {
    use cairn_state::queue::Fence;
    let db = store.open();
    db.insert_run(&run("run555", 1)).unwrap();
    db.enqueue_run("run555").unwrap();
    let first = db
        .claim_job("w1", Duration::from_millis(50), &["run"])
        .unwrap()
        .unwrap();
    let w1 = store.open();
    w1.set_fence(Some(Fence {
        job: first.id.clone(),
        epoch: first.epoch,
    }));
    w1.insert_pending_artifact(&artifact("old1", "run555", "/out")).unwrap();
    // Pending: not listed, but kept from the collector while its claim holds.
    assert!(db.artifacts(Some("run555")).unwrap().is_empty());
    assert_eq!(w1.pending_artifacts("run555", "a", "").unwrap().len(), 1);
    assert_eq!(db.live_pending_artifacts().unwrap().len(), 1);
    // Taken over: w1's pending artifact can no longer be committed, and goes.
    std::thread::sleep(Duration::from_millis(100));
    let second = db.claim_job("w2", Duration::from_secs(30), &["run"]).unwrap().unwrap();
    assert!(db.live_pending_artifacts().unwrap().is_empty());
    let dropped: Vec<String> = db
        .events_of("run555")
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "artifact-dropped")
        .map(|e| e.detail)
        .collect();
    assert!(
        dropped.len() == 1 && dropped[0].contains("/out") && dropped[0].contains("claim 1"),
        "{dropped:?}"
    );
    assert!(matches!(
        w1.insert_pending_artifact(&artifact("old2", "run555", "/late")),
        Err(StateError::Fenced { .. })
    ));
    // w2's own, committed with the stage's completion and only then.
    let mut w2 = store.open();
    w2.set_fence(Some(Fence {
        job: second.id.clone(),
        epoch: second.epoch,
    }));
    w2.put_stage(&stage("run555", "a", "", "running"), None).unwrap();
    w2.insert_pending_artifact(&artifact("new1", "run555", "/out")).unwrap();
    assert!(db.artifacts(Some("run555")).unwrap().is_empty());
    w2.put_stage(
        &stage("run555", "a", "", "completed"),
        Some(("completed", "by w2", None)),
    )
    .unwrap();
    let ids: Vec<String> = db
        .artifacts(Some("run555"))
        .unwrap()
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(ids, ["new1"]);
    assert!(db.live_pending_artifacts().unwrap().is_empty());
    // Outside the queue: pending while the stage runs; a failure drops it.
    let mut local = store.open();
    let mut b = artifact("loc1", "run555", "/b");
    b.stage = "b".into();
    local.put_stage(&stage("run555", "b", "", "running"), None).unwrap();
    local.insert_pending_artifact(&b).unwrap();
    assert_eq!(db.live_pending_artifacts().unwrap().len(), 1);
    local.put_stage(&stage("run555", "b", "", "failed"), None).unwrap();
    assert!(db.live_pending_artifacts().unwrap().is_empty());
    assert_eq!(db.artifacts(Some("run555")).unwrap().len(), 1);
}

fn artifacts_are_replaced_by_id_and_listed_per_run(store: &Store) {
    let db = store.open();
    db.insert_artifact(&artifact("a1", "r1", "/b")).unwrap();
    db.insert_artifact(&artifact("a2", "r1", "/a")).unwrap();
    db.insert_artifact(&artifact("a3", "r2", "/c")).unwrap();
    let mut replaced = artifact("a1", "r1", "/z");
    replaced.content_hash = "h2".into();
    db.insert_artifact(&replaced).unwrap();
    let r1: Vec<(String, String)> = db
        .artifacts(Some("r1"))
        .unwrap()
        .into_iter()
        .map(|a| (a.id, a.path))
        .collect();
    assert_eq!(r1, vec![("a2".into(), "/a".into()), ("a1".into(), "/z".into())]);
    let all = db.artifacts(None).unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(all[0].size_bytes, 1 << 40);
    assert!(db.artifacts(Some("r3")).unwrap().is_empty());
}

fn dead_letter(id: &str, run: &str) -> DeadLetter {
    DeadLetter {
        id: id.into(),
        run_id: run.into(),
        stage: "a".into(),
        branch: "".into(),
        error: "exit 1".into(),
        failure_snapshot: Some("fail".into()),
        input_snapshot: None,
        created_at: 9,
        retried_at: None,
    }
}

fn dead_letters_round_trip_and_remember_their_retry(store: &Store) {
    let db = store.open();
    db.insert_dead_letter(&dead_letter("dl1", "r1")).unwrap();
    let mut second = dead_letter("dl2", "r1");
    second.created_at = 10;
    second.input_snapshot = Some("input".into());
    db.insert_dead_letter(&second).unwrap();
    assert!(
        db.insert_dead_letter(&second).is_err(),
        "a dead letter is recorded once"
    );
    db.mark_dead_letter_retried("dl1", 99).unwrap();
    let got = db.dead_letters().unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!((got[0].id.as_str(), got[0].retried_at), ("dl1", Some(99)));
    assert_eq!(got[1].retried_at, None);
    let kept = db.pipeline_snapshots().unwrap();
    assert!(kept.contains("fail") && kept.contains("input"), "{kept:?}");
}

fn events_keep_their_order_and_snapshots(store: &Store) {
    let db = store.open();
    for i in 0..20 {
        let snapshot = (i % 2 == 0).then(|| format!("s{i}"));
        db.event("r", Some("st"), None, &format!("k{i}"), "d", snapshot.as_deref())
            .unwrap();
    }
    db.event("other", None, Some("b"), "x", "d", None).unwrap();
    let events = db.events_of("r").unwrap();
    let kinds: Vec<String> = events.iter().map(|e| e.kind.clone()).collect();
    assert_eq!(kinds, (0..20).map(|i| format!("k{i}")).collect::<Vec<_>>());
    assert!(events.windows(2).all(|w| w[0].seq < w[1].seq));
    assert_eq!(events[0].snapshot_id.as_deref(), Some("s0"));
    assert_eq!(events[1].snapshot_id, None);
    assert_eq!(
        (events[0].stage.as_deref(), events[0].branch.as_deref()),
        (Some("st"), None)
    );
    assert!(events[0].created_at > 0);
    assert_eq!(db.events_of("other").unwrap()[0].branch.as_deref(), Some("b"));
}

fn typed_events_keep_their_fields_and_a_won_event_names_its_branch(store: &Store) {
    let mut db = store.open();
    db.insert_run(&run("r", 1)).unwrap();
    let won = EventData::Won {
        branch: "small".into(),
        rule: "min".into(),
        metric: Some(0.5),
        runner_up: Some("large".into()),
        runner_up_metric: Some(2.5),
        chosen_by: None,
        reason: None,
    };
    // The group's row has no branch; its `won` event names the winner.
    let mut group = stage("r", "sweep", "", "completed");
    group.output_snapshot = Some("out".into());
    db.put_stage_event(&group, NewEvent::typed(won.clone(), Some("out")))
        .unwrap();
    let retry = EventData::Attempt {
        attempt: 2,
        parent_snapshot: Some("cp".into()),
        checkpoint: Some("cp".into()),
        image: None,
        restore_ms: 4,
    };
    db.put_stage_event(
        &stage("r", "align", "", "running"),
        NewEvent::typed(retry.clone(), Some("cp")),
    )
    .unwrap();
    db.event("r", None, None, "queued", "plain sentence", None).unwrap();
    // Stage rows counted per run and status.
    assert_eq!(
        db.stage_counts().unwrap(),
        vec![
            ("r".to_string(), "completed".to_string(), 1),
            ("r".to_string(), "running".to_string(), 1)
        ]
    );
    let events = db.events_of("r").unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(
        (events[0].kind.as_str(), events[0].branch.as_deref()),
        ("won", Some("small"))
    );
    assert_eq!(events[0].data.as_ref(), Some(&won));
    assert_eq!(events[0].detail, won.sentence());
    assert_eq!(
        (events[1].kind.as_str(), events[1].data.as_ref()),
        ("retry", Some(&retry))
    );
    assert!(events[1].detail.contains("restores checkpoint"), "{}", events[1].detail);
    assert_eq!(
        (events[2].detail.as_str(), events[2].data.as_ref()),
        ("plain sentence", None)
    );
    // Fields from a future Cairn are refused, naming the event.
    db.with(|b| {
        Ok(b.execute(
            "UPDATE events SET data = $1 WHERE kind = 'won'",
            &[Value::Text(r#"{"v":3,"type":"won"}"#.into())],
        )?)
    })
    .unwrap();
    let err = db.events_of("r").unwrap_err();
    assert!(matches!(err, StateError::EventData { .. }), "{err}");
    assert!(err.to_string().contains("upgrade Cairn"), "{err}");
}

fn a_newer_schema_is_refused(store: &Store) {
    let db = store.open();
    store.set_schema_version(&db, 99);
    drop(db);
    let err = Db::open_home(&store.home()).err().expect("a newer schema opened");
    assert!(matches!(err, StateError::FutureSchema { found: 99, .. }), "{err}");
    assert!(err.to_string().contains("newer Cairn"), "{err}");
}

fn a_failing_transaction_leaves_nothing(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("taken1", "taken")).unwrap();
    let insert = "INSERT INTO runs (id, pipeline, file, spec, params, status, created_at)
                  VALUES ($1, 'p', 'f', 's', '', 'running', 1)";
    // An error the caller returns rolls everything back.
    let err = db
        .transaction(|b| {
            b.execute(insert, &[Value::from("gone1")])?;
            Err::<(), _>(StateError::Conflict("test".into()))
        })
        .unwrap_err();
    assert!(matches!(err, StateError::Conflict(_)));
    // So does a failing statement after a good one.
    let err = db
        .transaction(|b| {
            b.execute(insert, &[Value::from("gone2")])?;
            b.execute(
                "INSERT INTO sandboxes (id, name, image, driver, state, owner_pid, owner_start, memory_bytes,
                 cpu_millis, pids_max, created_at, auto_remove)
                 VALUES ('x', 'taken', 'i', 'd', 'creating', 1, 1, 1, 1, 1, 1, 0)",
                &[],
            )?;
            Ok(())
        })
        .unwrap_err();
    assert!(err.to_string().contains("sandboxes.name"), "{err}");
    assert!(db.find_runs("gone1").unwrap().is_empty());
    assert!(db.find_runs("gone2").unwrap().is_empty());
    // The connection is usable afterwards and commits what succeeds.
    db.transaction(|b| Ok(b.execute(insert, &[Value::from("kept1")])?))
        .unwrap();
    assert_eq!(store.open().find_runs("kept1").unwrap().len(), 1);
}

fn reopening_keeps_everything(store: &Store) {
    let mut db = store.open();
    db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
    db.insert_run(&run("run111", 1)).unwrap();
    drop(db);
    let db = store.open();
    assert_eq!(db.find_sandboxes("one").unwrap()[0].layers.len(), 3);
    assert_eq!(db.runs().unwrap().len(), 1);
}

fn stores_opened_at_once_migrate_once(store: &Store) {
    let dbs: Vec<Db> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| store.open())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    dbs[0].insert_run(&run("run111", 1)).unwrap();
    for db in &dbs {
        assert_eq!(db.runs().unwrap().len(), 1);
    }
}

// PostgreSQL only: one database belongs to one state directory, or to the
// state directories of hosts on one remote store.

#[test]
fn a_postgres_store_of_another_state_directory_is_refused() {
    let Some(store) = Store::postgres("a_postgres_store_of_another_state_directory_is_refused") else {
        return;
    };
    drop(store.open());
    let id = std::fs::read_to_string(store.dir.path().join("home-id")).unwrap();
    assert_eq!(id.trim().len(), 32, "{id:?}");
    let other = tempfile::tempdir().unwrap();
    let err = Db::open_home(&Home::at(other.path()).with_state(&store.db.as_ref().unwrap().url))
        .err()
        .expect("another home opened the database");
    assert!(matches!(err, StateError::ForeignHome { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&store.dir.path().display().to_string()), "{msg}");
    assert!(msg.contains("--home"), "{msg}");
    // The owner still opens it.
    drop(store.open());
    // Homes on one remote store share the database; another store is refused.
    let url = &store.db.as_ref().unwrap().url;
    drop(
        Db::open_home(
            &Home::at(store.dir.path())
                .with_state(url)
                .with_store("s3://b/p?endpoint=http://a:1"),
        )
        .unwrap(),
    );
    drop(
        Db::open_home(
            &Home::at(other.path())
                .with_state(url)
                .with_store("s3://b/p?endpoint=http://b:2"),
        )
        .unwrap(),
    );
    let err = Db::open_home(&Home::at(other.path()).with_state(url).with_store("s3://elsewhere/p"))
        .err()
        .expect("a home on another store opened the database");
    assert!(err.to_string().contains("--store s3://b/p"), "{err}");
}

#[test]
fn an_unreachable_postgres_store_says_what_to_do_without_the_password() {
    let home = tempfile::tempdir().unwrap();
    // Port 1 on loopback: nothing listens there.
    let url = "postgres://cairn:hunter2@127.0.0.1:1/state?connect_timeout=5";
    let err = Db::open_home(&Home::at(home.path()).with_state(url))
        .err()
        .expect("connected to nothing");
    let msg = err.to_string();
    assert!(matches!(err, StateError::Connect { .. }), "{msg}");
    assert!(msg.contains("127.0.0.1:1/state"), "{msg}");
    assert!(msg.contains("refused"), "the cause is named: {msg}");
    assert!(msg.contains("CAIRN_STATE"), "{msg}");
    assert!(!msg.contains("hunter2"), "{msg}");
}

#[test]
fn bad_state_urls_are_refused_with_the_forms_that_work() {
    let home = tempfile::tempdir().unwrap();
    for url in [
        "mysql://root:hunter2@db/x",
        "sqlite:",
        "postgres://u:hunter2@h:notaport/db",
    ] {
        let err = Db::open_home(&Home::at(home.path()).with_state(url))
            .err()
            .unwrap_or_else(|| panic!("{url} opened"));
        let msg = err.to_string();
        assert!(matches!(err, StateError::BadLocation { .. }), "{url}: {msg}");
        assert!(msg.contains("postgres://USER@HOST:PORT/DATABASE"), "{msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
    }
    // sqlite:PATH is the embedded store at that path.
    let path = home.path().join("elsewhere.db");
    let db = Db::open_home(&Home::at(home.path()).with_state(format!("sqlite:{}", path.display()))).unwrap();
    assert_eq!(db.kind(), BackendKind::Sqlite);
    assert!(path.exists());
}

/// Ends every other session on the test's database, as a server restart or
/// a dropped network path would.
fn drop_connections(db: &TestDatabase) {
    let ended = db.count(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    );
    assert!(ended >= 1, "no session of the store was there to end");
}

#[test]
fn a_postgres_store_reconnects_after_its_connection_is_dropped() {
    let Some(store) = Store::postgres("a_postgres_store_reconnects_after_its_connection_is_dropped") else {
        return;
    };
    let mut db = store.open();
    let image = |name: &str| ImageRecord {
        name: name.into(),
        source: "test".into(),
        size_bytes: 1,
        created_at: 1,
        layers: vec!["00".repeat(32)],
        config: None,
    };
    db.put_image(&image("before")).unwrap();
    let test_db = store.db.as_ref().unwrap();
    // Dropped while idle (a long stage runs): a transaction comes next.
    drop_connections(test_db);
    std::thread::sleep(Duration::from_millis(300));
    db.put_image(&image("after")).unwrap();
    let names: Vec<String> = db.images().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["after", "before"]);
    // Again, with single statements next.
    drop_connections(test_db);
    std::thread::sleep(Duration::from_millis(300));
    db.insert_run(&run("reconnected", 5)).unwrap();
    assert!(db.runs().unwrap().iter().any(|r| r.id == "reconnected"));
    assert!(db.image("before").unwrap().is_some());
}

fn tokens_are_found_by_hash_only_and_revoked_by_id_or_name(store: &Store) {
    let db = store.open();
    let token = |id: &str, name: &str| TokenRecord {
        id: id.into(),
        name: name.into(),
        created_at: 1,
        last_used: None,
        tenant: None,
    };
    db.insert_token(&token("t1", "ci"), "hash-1").unwrap();
    db.insert_token(&token("t2", "laptop"), "hash-2").unwrap();
    assert!(
        db.insert_token(&token("t3", "again"), "hash-1").is_err(),
        "a hash is unique"
    );
    assert_eq!(
        db.use_token("t1", 5).unwrap().map(|t| t.id),
        None,
        "an id is not a secret"
    );
    let used = db.use_token("hash-2", 100_000).unwrap().unwrap();
    assert_eq!(used.name, "laptop");
    assert_eq!(db.tokens().unwrap()[1].last_used, Some(100_000));
    assert!(db.token_exists("t2").unwrap() && !db.token_exists("hash-2").unwrap());
    assert_eq!(db.token_ids().unwrap(), ["t1".to_string(), "t2".to_string()].into());
    assert_eq!(db.delete_token("laptop").unwrap(), 1);
    assert!(!db.token_exists("t2").unwrap(), "a removed token no longer exists");
    assert_eq!(db.delete_token("t1").unwrap(), 1);
    assert_eq!(db.delete_token("t1").unwrap(), 0);
    assert!(
        db.use_token("hash-2", 5).unwrap().is_none(),
        "a revoked token is refused"
    );
    assert!(db.tokens().unwrap().is_empty());
}

fn an_idempotency_key_answers_once_and_refuses_another_body(store: &Store) {
    let db = store.open();
    assert_eq!(db.claim_idempotency("create", "k", "body", 10, 0).unwrap(), Claim::New);
    assert_eq!(
        db.claim_idempotency("create", "k", "body", 11, 0).unwrap(),
        Claim::InFlight
    );
    assert_eq!(
        db.claim_idempotency("create", "k", "other", 11, 0).unwrap(),
        Claim::Mismatch
    );
    assert_eq!(
        db.claim_idempotency("fork", "k", "body", 11, 0).unwrap(),
        Claim::New,
        "keys are per route"
    );
    // A claim older than the server's start belonged to a server that is gone.
    assert_eq!(db.claim_idempotency("create", "k", "body", 20, 15).unwrap(), Claim::New);
    db.answer_idempotency("create", "k", 201, "{\"id\":\"x\"}").unwrap();
    let answered = Claim::Answered {
        status: 201,
        body: "{\"id\":\"x\"}".into(),
    };
    assert_eq!(db.claim_idempotency("create", "k", "body", 30, 25).unwrap(), answered);
    db.release_idempotency("create", "k").unwrap();
    assert_eq!(
        db.claim_idempotency("create", "k", "body", 31, 0).unwrap(),
        answered,
        "an answer stays"
    );
    db.release_idempotency("fork", "k").unwrap();
    assert_eq!(
        db.claim_idempotency("fork", "k", "body", 32, 0).unwrap(),
        Claim::New,
        "a released claim is free"
    );
}

fn e2b_sandbox(id: &str, life: E2bLife) -> E2bSandbox {
    E2bSandbox {
        id: id.into(),
        template: "base".into(),
        life,
        started_at: 10,
        end_at: 20,
        auto_pause: true,
        cpu_count: 2,
        memory_mb: 512,
        metadata: [("owner".to_string(), "ci".to_string())].into(),
        env: [("A".to_string(), "1".to_string()), ("B".to_string(), "x=y".to_string())].into(),
        grant: (id != "e2").then(|| format!("token-of-{id}")),
        network: (id == "e1").then(|| cairn_state::e2b::E2bNetwork {
            allow_out: vec!["pypi.org".into(), "10.0.0.0/8".into()],
            deny_out: vec!["0.0.0.0/0".into()],
        }),
        workdir: (id == "e1").then(|| "/app".to_string()),
        public_traffic: id == "e1",
        tenant: (id == "e1").then(|| "acme".to_string()),
    }
}

fn e2b_sandboxes_keep_their_id_through_pause_and_resume(store: &Store) {
    let db = store.open();
    let running = e2b_sandbox("e1", E2bLife::Running { sandbox: "c1".into() });
    db.put_e2b_sandbox(&running).unwrap();
    db.put_e2b_sandbox(&e2b_sandbox("e2", E2bLife::Running { sandbox: "c2".into() }))
        .unwrap();
    assert_eq!(
        db.e2b_sandboxes().unwrap(),
        vec![
            running.clone(),
            e2b_sandbox("e2", E2bLife::Running { sandbox: "c2".into() })
        ]
    );

    let mut paused = running.clone();
    paused.life = E2bLife::Paused { snapshot: "s1".into() };
    paused.env.remove("B");
    db.put_e2b_sandbox(&paused).unwrap();
    let mut resumed = paused.clone();
    resumed.life = E2bLife::Running { sandbox: "c3".into() };
    drop(db);
    let db = store.open();
    assert_eq!(
        db.e2b_sandboxes().unwrap()[0],
        paused,
        "a paused sandbox survives reopening"
    );
    db.put_e2b_sandbox(&resumed).unwrap();
    assert_eq!(db.e2b_sandboxes().unwrap()[0], resumed);

    assert!(db.delete_e2b_sandbox("e1").unwrap());
    assert!(!db.delete_e2b_sandbox("e1").unwrap());
    assert_eq!(db.e2b_sandboxes().unwrap().len(), 1);
}

fn e2b_template_builds_take_their_tags_only_when_ready(store: &Store) {
    use cairn_state::e2b_templates::{BuildFailure, BuildLogLine, BuildStatus};
    use cairn_state::ImageConfig;
    let db = store.open();
    let tags = vec!["default".to_string(), "v1".to_string()];
    let t = db.start_e2b_template_build("my-env", "t1", "b1", &tags, 100).unwrap();
    assert_eq!((t.id.as_str(), t.name.as_str()), ("t1", "my-env"));
    // A second build of the same name keeps the template's id.
    let again = db
        .start_e2b_template_build("my-env", "t-unused", "b2", &["v2".to_string()], 200)
        .unwrap();
    assert_eq!(again.id, "t1");
    assert_eq!(db.e2b_templates().unwrap().len(), 1);
    assert_eq!(db.e2b_template("t1").unwrap(), Some(t.clone()), "found by id");
    assert_eq!(db.e2b_template("my-env").unwrap(), Some(t.clone()), "found by name");
    assert_eq!(db.e2b_template("nope").unwrap(), None);
    let b1 = db.e2b_template_build("b1").unwrap().unwrap();
    assert_eq!((b1.status, b1.tags.clone()), (BuildStatus::Waiting, tags.clone()));
    assert!(db.claim_e2b_template_build("b1").unwrap());
    assert!(!db.claim_e2b_template_build("b1").unwrap(), "a build starts once");
    assert!(
        db.e2b_template_tags("t1").unwrap().is_empty(),
        "no tag before the build is ready"
    );
    assert_eq!(db.unfinished_e2b_template_builds().unwrap().len(), 2);

    let config = ImageConfig {
        env: [("A".to_string(), "1".to_string())].into(),
        workdir: Some("/app".into()),
        user: Some("user".into()),
        start_cmd: Some("serve".into()),
        ready_cmd: Some("check".into()),
    };
    let logs = vec![BuildLogLine {
        at: 150,
        level: "info".into(),
        message: "RUN true".into(),
        step: Some(1),
    }];
    db.finish_e2b_template_build(&b1, Ok(("e2b-t1-b1", &config)), &logs, 300)
        .unwrap();
    let b1 = db.e2b_template_build("b1").unwrap().unwrap();
    assert_eq!(b1.status, BuildStatus::Ready);
    assert_eq!(
        (b1.image.as_deref(), b1.config.as_ref(), b1.logs.clone()),
        (Some("e2b-t1-b1"), Some(&config), logs)
    );
    let named: Vec<(String, String)> = db
        .e2b_template_tags("t1")
        .unwrap()
        .into_iter()
        .map(|t| (t.tag, t.build_id))
        .collect();
    assert_eq!(named, vec![("default".into(), "b1".into()), ("v1".into(), "b1".into())]);

    let b2 = db.e2b_template_build("b2").unwrap().unwrap();
    let failure = BuildFailure {
        message: "step 1 failed".into(),
        step: Some(1),
    };
    db.finish_e2b_template_build(&b2, Err(&failure), &[], 400).unwrap();
    let b2 = db.e2b_template_build("b2").unwrap().unwrap();
    assert_eq!((b2.status, b2.reason), (BuildStatus::Error, Some(failure)));
    assert_eq!(
        db.e2b_template_tags("t1").unwrap().len(),
        2,
        "a failed build takes no tag"
    );
    assert!(db.unfinished_e2b_template_builds().unwrap().is_empty());

    db.tag_e2b_template_build("t1", "b1", &["stable".to_string(), "v1".to_string()], 500)
        .unwrap();
    assert_eq!(db.e2b_template_tags("t1").unwrap().len(), 3);
    assert_eq!(
        db.untag_e2b_template("t1", &["stable".to_string(), "nope".to_string()])
            .unwrap(),
        1
    );
    drop(db);
    let db = store.open();
    assert_eq!(db.e2b_template_tags("t1").unwrap().len(), 2, "tags survive reopening");
    assert_eq!(db.delete_e2b_template("t1").unwrap(), vec!["e2b-t1-b1".to_string()]);
    assert!(db.e2b_templates().unwrap().is_empty());
    assert!(db.e2b_template_build("b1").unwrap().is_none());
    assert!(db.e2b_template_tags("t1").unwrap().is_empty());
}

fn e2b_snapshots_are_listed_oldest_first_and_deleted_once(store: &Store) {
    let db = store.open();
    let snap = |id: &str, at: i64| E2bSnapshot {
        id: id.into(),
        name: format!("name-{id}"),
        e2b_id: "e1".into(),
        created_at: at,
    };
    db.insert_e2b_snapshot(&snap("b", 2)).unwrap();
    db.insert_e2b_snapshot(&snap("a", 5)).unwrap();
    assert!(
        db.insert_e2b_snapshot(&snap("a", 6)).is_err(),
        "a snapshot is recorded once"
    );
    assert_eq!(db.e2b_snapshots().unwrap(), vec![snap("b", 2), snap("a", 5)]);
    assert!(db.delete_e2b_snapshot("b").unwrap());
    assert!(!db.delete_e2b_snapshot("b").unwrap());
    assert_eq!(db.e2b_snapshots().unwrap(), vec![snap("a", 5)]);
}

fn session(id: &str, name: &str) -> SessionRecord {
    SessionRecord {
        id: id.into(),
        name: name.into(),
        state: SessionState::Active,
        image: "busybox".into(),
        driver: "native".into(),
        sandbox_id: Some("sb1".into()),
        snapshot_id: None,
        snapshot_seq: None,
        idle_timeout_ms: Some(300_000),
        parent_id: None,
        fork_seq: None,
        fork_reason: None,
        fork_rewinds: 0,
        head_seq: 0,
        head_hash: GENESIS.into(),
        rewinds: 0,
        owner_pid: 1,
        owner_start: 2,
        error: None,
        created_at: 7,
        updated_at: 7,
        network: None,
    }
}

fn note(text: &str) -> Entry {
    let mut e = Entry::new(EntryKind::Note);
    e.content = Some(text.into());
    e
}

fn sessions_round_trip_are_found_by_name_or_prefix_and_names_are_unique(store: &Store) {
    let db = store.open();
    let mut s = session("abcdef012345", "agent");
    s.network = Some(cairn_sandbox::net::NetPolicy::parse(None, &["10.1.0.0/16:5432".into()], &[]).unwrap());
    db.insert_session(&s).unwrap();
    assert_eq!(db.session_by_id(&s.id).unwrap().unwrap(), s);
    assert_eq!(db.find_sessions("agent").unwrap(), vec![s.clone()]);
    assert_eq!(db.find_sessions("abc").unwrap(), vec![s.clone()]);
    assert!(
        db.find_sessions("ab").unwrap().is_empty(),
        "a prefix needs 3 characters"
    );
    assert!(matches!(
        db.insert_session(&session("999999999999", "agent")),
        Err(StateError::NameTaken(n)) if n == "agent"
    ));
    let mut child = session("fedcba987654", "child");
    child.parent_id = Some(s.id.clone());
    child.fork_seq = Some(0);
    child.fork_reason = Some("why".into());
    db.insert_session(&child).unwrap();
    assert_eq!(db.session_children(&s.id).unwrap(), vec![child.id.clone()]);
    drop(db);
    let db = store.open();
    assert_eq!(db.sessions().unwrap(), vec![s, child]);
}

fn session_moves_are_compare_and_set_on_state_and_owner(store: &Store) {
    let db = store.open();
    let s = session("s1", "s1");
    db.insert_session(&s).unwrap();
    let (old, new) = ((1, 2), (3, 4));
    assert!(!db
        .move_session(
            "s1",
            SessionState::Suspended,
            old,
            SessionState::Resuming,
            new,
            None,
            None
        )
        .unwrap());
    assert!(!db
        .move_session(
            "s1",
            SessionState::Active,
            (1, 9),
            SessionState::Suspending,
            new,
            None,
            None
        )
        .unwrap());
    assert!(db
        .move_session(
            "s1",
            SessionState::Active,
            old,
            SessionState::Suspending,
            new,
            Some("sb1"),
            None
        )
        .unwrap());
    assert!(
        !db.move_session(
            "s1",
            SessionState::Active,
            old,
            SessionState::Suspending,
            new,
            None,
            None
        )
        .unwrap(),
        "the loser of a race changes nothing"
    );
    assert!(db
        .set_session_sandbox("s1", SessionState::Suspending, new, None)
        .unwrap());
    let got = db.session_by_id("s1").unwrap().unwrap();
    assert_eq!(
        (got.state, got.owner_pid, got.owner_start, got.sandbox_id),
        (SessionState::Suspending, 3, 4, None)
    );
    assert!(!SessionState::Suspended.valid_transition(SessionState::Active));
    assert!(SessionState::Suspending.valid_transition(SessionState::Resuming));
    assert!(!SessionState::Closed.valid_transition(SessionState::Resuming));
}

fn log_entries_get_gapless_seqs_and_a_hash_chain_and_rewinds_hide_ranges(store: &Store) {
    let db = store.open();
    db.insert_session(&session("s1", "s1")).unwrap();
    let mut snap = note("suspended");
    snap.snapshot_id = Some("snap-1".into());
    let first = db.append_entries("s1", &[note("a"), note("b"), snap]).unwrap();
    assert_eq!(first.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
    let mut previous = GENESIS.to_string();
    for e in &first {
        assert_eq!(e.hash, e.chain(&previous));
        previous = e.hash.clone();
    }
    let s = db.session_by_id("s1").unwrap().unwrap();
    assert_eq!((s.head_seq, s.head_hash.as_str()), (3, previous.as_str()));
    assert_eq!((s.snapshot_id.as_deref(), s.snapshot_seq), (Some("snap-1"), Some(3)));
    db.append_entries("s1", &[note("c"), note("d")]).unwrap();

    let all = [Segment {
        session: "s1".into(),
        lo: 0,
        hi: 5,
    }];
    let read = |hidden: &[(u64, u64)], order, limit| {
        db.read_entries(&all, hidden, order, limit, false)
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect::<Vec<_>>()
    };
    assert_eq!(read(&[], Order::Ascending { from: 2 }, 2), vec![2, 3]);
    assert_eq!(read(&[], Order::Descending, 2), vec![5, 4]);
    assert_eq!(read(&[(1, 3)], Order::Ascending { from: 1 }, 10), vec![1, 4, 5]);
    let snaps = db.read_entries(&all, &[], Order::Descending, 1, true).unwrap();
    assert_eq!(snaps[0].seq, 3);
    assert_eq!(db.raw_entries(&all[0], 4, 10).unwrap().len(), 2);
    assert_eq!(db.raw_entries(&all[0], 1, 10).unwrap(), {
        let mut v = first.clone();
        v.extend(db.raw_entries(&all[0], 4, 10).unwrap());
        v
    });

    assert!(
        matches!(db.add_rewind("s1", 2, 4), Err(StateError::Conflict(_))),
        "a stale head is refused"
    );
    let r = db.add_rewind("s1", 2, 5).unwrap();
    assert_eq!((r.n, r.to_seq, r.head_seq), (1, 2, 5));
    assert_eq!(db.rewinds("s1").unwrap(), vec![r]);
    assert_eq!(db.session_by_id("s1").unwrap().unwrap().rewinds, 1);
    assert!(db.session_snapshots().unwrap().contains("snap-1"));

    let mut big = note("");
    big.content = None;
    big.content_ref = Some("feed".into());
    db.append_entries("s1", &[big]).unwrap();
    assert!(db.session_payloads().unwrap().contains("feed"));

    db.move_session(
        "s1",
        SessionState::Active,
        (1, 2),
        SessionState::Closed,
        (1, 2),
        None,
        None,
    )
    .unwrap();
    assert!(
        db.append_entries("s1", &[note("late")]).is_err(),
        "a closed log takes no entries"
    );
    db.delete_session("s1").unwrap();
    assert!(db.session_by_id("s1").unwrap().is_none());
    assert!(db.raw_entries(&all[0], 1, 10).unwrap().is_empty());
    assert!(db.rewinds("s1").unwrap().is_empty());
}

fn concurrent_appenders_never_leave_a_gap_or_a_duplicate(store: &Store) {
    store.open().insert_session(&session("s1", "s1")).unwrap();
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let db = store.open();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..10 {
                    db.append_entries("s1", &[note(&format!("{t}-{i}"))]).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let db = store.open();
    let seg = Segment {
        session: "s1".into(),
        lo: 0,
        hi: 40,
    };
    let rows = db.raw_entries(&seg, 1, 100).unwrap();
    assert_eq!(
        rows.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=40).collect::<Vec<_>>()
    );
    let mut previous = GENESIS.to_string();
    for e in &rows {
        assert_eq!(e.hash, e.chain(&previous), "entry {}", e.seq);
        previous = e.hash.clone();
    }
    assert_eq!(db.session_by_id("s1").unwrap().unwrap().head_hash, previous);
}

fn a_long_log_reads_by_range_and_tail_around_abandoned_stretches(store: &Store) {
    let db = store.open();
    db.insert_session(&session("s1", "s1")).unwrap();
    let batch: Vec<Entry> = (0..1000).map(|i| note(&i.to_string())).collect();
    for _ in 0..5 {
        db.append_entries("s1", &batch).unwrap();
    }
    let seg = [Segment {
        session: "s1".into(),
        lo: 0,
        hi: 5000,
    }];
    let seqs = |hidden: &[(u64, u64)], order, limit| {
        db.read_entries(&seg, hidden, order, limit, false)
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect::<Vec<_>>()
    };
    assert_eq!(seqs(&[], Order::Descending, 3), vec![5000, 4999, 4998]);
    assert_eq!(seqs(&[], Order::Ascending { from: 2500 }, 3), vec![2500, 2501, 2502]);
    let hidden = [(10, 4998), (2, 5)];
    assert_eq!(
        seqs(&hidden, Order::Ascending { from: 1 }, 100),
        vec![1, 2, 6, 7, 8, 9, 10, 4999, 5000]
    );
    assert_eq!(seqs(&hidden, Order::Descending, 3), vec![5000, 4999, 10]);
    // Paging back: below a seq, around the abandoned stretches.
    assert_eq!(seqs(&[], Order::Below { before: 2500 }, 3), vec![2499, 2498, 2497]);
    assert_eq!(seqs(&hidden, Order::Below { before: 4999 }, 3), vec![10, 9, 8]);
    assert_eq!(seqs(&hidden, Order::Below { before: 7 }, 10), vec![6, 2, 1]);
    assert!(seqs(&hidden, Order::Below { before: 1 }, 10).is_empty());
    // The chain of a long log, end to end.
    let mut previous = GENESIS.to_string();
    let mut from = 1;
    loop {
        let rows = db.raw_entries(&seg[0], from, 1000).unwrap();
        let Some(last) = rows.last() else { break };
        from = last.seq + 1;
        for e in &rows {
            assert_eq!(e.hash, e.chain(&previous));
            previous = e.hash.clone();
        }
    }
    assert_eq!(from, 5001);
    assert_eq!(db.session_by_id("s1").unwrap().unwrap().head_hash, previous);
}

fn idle_sessions_are_active_ones_past_their_timeout(store: &Store) {
    let db = store.open();
    // Changed at 7 with a 300 s timeout: idle from 300 007 on.
    db.insert_session(&session("idle00000001", "idle")).unwrap();
    let mut none = session("idle00000002", "no-timeout");
    none.idle_timeout_ms = None;
    db.insert_session(&none).unwrap();
    let mut asleep = session("idle00000003", "suspended");
    asleep.state = SessionState::Suspended;
    db.insert_session(&asleep).unwrap();
    let ids = |now| -> Vec<String> { db.idle_sessions(now).unwrap().into_iter().map(|s| s.id).collect() };
    assert!(ids(300_006).is_empty());
    assert_eq!(ids(300_007), ["idle00000001"]);
    assert_eq!(
        ids(i64::MAX / 2),
        ["idle00000001"],
        "only active sessions with a timeout"
    );
}

fn an_imported_session_is_recorded_whole_or_not_at_all(store: &Store) {
    let db = store.open();
    let mut previous = GENESIS.to_string();
    let entries: Vec<Entry> = (1..=3)
        .map(|seq| {
            let mut e = note(&format!("n{seq}"));
            e.seq = seq;
            e.created_at = seq as i64;
            if seq == 3 {
                e.snapshot_id = Some("snap-1".into());
            }
            e.hash = e.chain(&previous);
            previous = e.hash.clone();
            e
        })
        .collect();
    let rewinds = [Rewind {
        n: 1,
        to_seq: 1,
        head_seq: 2,
        created_at: 9,
    }];
    let snap = snapshot("snap-1", None, "gone", None, 5);
    let image = ImageRecord {
        name: "imported".into(),
        source: "test".into(),
        size_bytes: 1,
        created_at: 3,
        layers: vec!["base".into()],
        config: None,
    };
    let imported = |id: &str, name: &str| SessionRecord {
        state: SessionState::Suspended,
        sandbox_id: None,
        snapshot_id: Some("snap-1".into()),
        snapshot_seq: Some(3),
        head_seq: 3,
        head_hash: previous.clone(),
        rewinds: 1,
        ..session(id, name)
    };
    db.insert_session(&session("taken1", "taken")).unwrap();
    let refused = db.import_session_rows(
        &imported("new1", "taken"),
        &entries,
        &rewinds,
        std::slice::from_ref(&snap),
        Some(&image),
    );
    assert!(matches!(refused, Err(StateError::NameTaken(_))), "{refused:?}");
    let segment = Segment {
        session: "new1".into(),
        lo: 0,
        hi: 3,
    };
    assert!(db.session_by_id("new1").unwrap().is_none());
    assert!(db.raw_entries(&segment, 1, 10).unwrap().is_empty());
    assert!(db.rewinds("new1").unwrap().is_empty());
    assert!(db.snapshots().unwrap().is_empty());
    assert!(db.image("imported").unwrap().is_none());

    let added = db
        .import_session_rows(
            &imported("new1", "fresh"),
            &entries,
            &rewinds,
            std::slice::from_ref(&snap),
            Some(&image),
        )
        .unwrap();
    assert!(added, "the image was new");
    assert_eq!(db.session_by_id("new1").unwrap().unwrap(), imported("new1", "fresh"));
    assert_eq!(db.raw_entries(&segment, 1, 10).unwrap(), entries);
    assert_eq!(
        db.rewinds("new1").unwrap(),
        vec![Rewind {
            n: 1,
            to_seq: 1,
            head_seq: 2,
            created_at: 9
        }]
    );
    assert_eq!(db.snapshots().unwrap()[0].layers, snap.layers);
    assert_eq!(db.image("imported").unwrap().unwrap().layers, vec!["base"]);
    // The same bundle again under another name shares the snapshot and image.
    let again = db
        .import_session_rows(&imported("new2", "fresh-2"), &entries, &rewinds, &[snap], Some(&image))
        .unwrap();
    assert!(!again, "the image was there");
    assert_eq!(db.snapshots().unwrap().len(), 1);
    assert_eq!(db.sessions().unwrap().len(), 3);
}

fn decision(run: &str, stage: &str, round: u32, key: &str) -> DecisionRecord {
    DecisionRecord {
        run_id: run.into(),
        stage: stage.into(),
        round,
        stage_key: key.into(),
        model: "anthropic/m".into(),
        answer: "{\"v\":1,\"answer\":{\"reason\":\"r\"}}".into(),
        reason: "r".into(),
        input_tokens: 1 << 40,
        output_tokens: 7,
        calls: 2,
        created_at: 50 + i64::from(round),
    }
}

fn decisions_are_recorded_with_their_effect_in_one_transaction(store: &Store) {
    let mut db = store.open();
    db.insert_run(&run("r1", 1)).unwrap();
    let mut measure = stage("r1", "measure", "", "completed");
    measure.output_snapshot = Some("out".into());
    db.put_stage(&measure, None).unwrap();
    assert!(db.completed_key("measure-v1").unwrap().is_some());

    // Completed: the decision, the row and its key, together.
    let mut choose = stage("r1", "choose", "", "completed");
    choose.stage_key = "choose-v1".into();
    choose.output_snapshot = Some("out".into());
    db.record_decision(
        &decision("r1", "choose", 1, "choose-v1"),
        &choose,
        NewEvent::text("decided", "d", None),
        DecisionEffect::Complete,
    )
    .unwrap();
    let got = db.decisions_of("r1").unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].input_tokens, got[0].output_tokens, got[0].calls),
        (1 << 40, 7, 2)
    );
    assert_eq!(got[0].answer, decision("r1", "choose", 1, "choose-v1").answer);
    let by_key = db.decision_by_key("choose-v1").unwrap().expect("the key's decision");
    assert_eq!((by_key.run_id.as_str(), by_key.stage.as_str()), ("r1", "choose"));
    assert_eq!(db.completed_key("choose-v1").unwrap().unwrap().0, "out");

    // Retry: the stage before is reset and its key forgotten.
    let mut judge = stage("r1", "judge", "", "pending");
    judge.stage_key = "judge-v1".into();
    let mut reset = measure.clone();
    reset.status = "pending".into();
    reset.output_snapshot = None;
    db.record_decision(
        &decision("r1", "judge", 1, "judge-v1"),
        &judge,
        NewEvent::text("decided", "retry", None),
        DecisionEffect::Retry { previous: &reset },
    )
    .unwrap();
    assert_eq!(db.stage("r1", "measure", "").unwrap().unwrap().status, "pending");
    assert!(db.completed_key("measure-v1").unwrap().is_none());
    assert!(
        db.decision_by_key("judge-v1").unwrap().is_none(),
        "only a completed key's decision is reused"
    );

    // A second decision of the same round is refused, and changes nothing.
    let mut dead = reset.clone();
    dead.status = "dead".into();
    let dl = dead_letter("dl1", "r1");
    assert!(db
        .record_decision(
            &decision("r1", "judge", 1, "judge-v1"),
            &judge,
            NewEvent::text("decided", "dlq", None),
            DecisionEffect::Dlq {
                previous: &dead,
                dead_letter: &dl,
                run_error: "e"
            },
        )
        .is_err());
    assert_eq!(db.stage("r1", "measure", "").unwrap().unwrap().status, "pending");
    assert!(db.dead_letters().unwrap().is_empty());

    // Dlq: the stage before is dead, a dead letter and the run failed.
    db.record_decision(
        &decision("r1", "judge", 2, "judge-v1"),
        &judge,
        NewEvent::text("decided", "dlq", None),
        DecisionEffect::Dlq {
            previous: &dead,
            dead_letter: &dl,
            run_error: "stage measure went to the dead-letter queue",
        },
    )
    .unwrap();
    assert_eq!(db.stage("r1", "measure", "").unwrap().unwrap().status, "dead");
    assert_eq!(db.dead_letters().unwrap().len(), 1);
    let r = db.find_runs("r1").unwrap().remove(0);
    assert_eq!(
        (r.status.as_str(), r.error.as_deref()),
        ("failed", Some("stage measure went to the dead-letter queue"))
    );
    assert_eq!(db.decisions_of("r1").unwrap().len(), 3);
    db.delete_run("r1").unwrap();
    assert!(db.decisions_of("r1").unwrap().is_empty());
}
