//! Save/resume behaviour of `verl-checkpoint`, including crash simulations.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::json;
use verl_checkpoint::{
    CheckpointError, CheckpointManager, KeepPolicy, Latest, ResumeDecision, ResumeMode, Role,
    RoleWriter, TRACKER_FILE,
};

fn writer(content: &'static str) -> RoleWriter<'static> {
    Box::new(move |dir: &Path| {
        fs::write(dir.join("model.bin"), content)?;
        fs::create_dir(dir.join("huggingface"))?;
        fs::write(dir.join("huggingface").join("config.json"), "{}")?;
        Ok(())
    })
}

fn save_step(ckpt: &CheckpointManager, step: u64) {
    let data = json!({ "step": step });
    ckpt.save(
        step,
        vec![
            (Role::Actor, writer("actor")),
            (Role::Critic, writer("critic")),
        ],
        Some(&data),
        Some(&json!({ "rng": [step, 7] })),
    )
    .unwrap();
}

fn resume(ckpt: &CheckpointManager, mode: &ResumeMode) -> ResumeDecision {
    ckpt.resolve_resume(mode).unwrap()
}

fn resumed_step(ckpt: &CheckpointManager) -> Option<u64> {
    match resume(ckpt, &ResumeMode::Auto) {
        ResumeDecision::Resume(p) => Some(p.global_step),
        ResumeDecision::Fresh { .. } => None,
    }
}

fn names(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn save_then_auto_resume_round_trips_layout_and_state() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path().join("ckpts"), KeepPolicy::default());
    assert_eq!(
        resume(&ckpt, &ResumeMode::Auto),
        ResumeDecision::Fresh { note: None }
    );

    save_step(&ckpt, 10);
    save_step(&ckpt, 20);
    let root = ckpt.root();
    assert_eq!(
        names(root),
        ["global_step_10", "global_step_20", TRACKER_FILE]
    );
    assert_eq!(fs::read_to_string(root.join(TRACKER_FILE)).unwrap(), "20");
    let step = root.join("global_step_20");
    assert_eq!(
        names(&step),
        ["actor", "critic", "data.json", "trainer_state.json"]
    );
    assert_eq!(
        fs::read_to_string(step.join("actor/model.bin")).unwrap(),
        "actor"
    );
    assert!(step.join("critic/huggingface/config.json").is_file());

    let ResumeDecision::Resume(point) = resume(&ckpt, &ResumeMode::Auto) else {
        panic!("expected resume")
    };
    assert_eq!(point.global_step, 20);
    assert_eq!(point.dir, step);
    assert_eq!(point.data_state, Some(json!({ "step": 20 })));
    assert_eq!(point.trainer_state, Some(json!({ "rng": [20, 7] })));
    assert_eq!(
        point.require_role(Role::Critic).unwrap(),
        step.join("critic")
    );
}

#[test]
fn disable_ignores_existing_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 3);
    let mode = ResumeMode::from_verl("disable", Some("ignored")).unwrap();
    assert_eq!(resume(&ckpt, &mode), ResumeDecision::Fresh { note: None });
}

#[test]
fn failing_writer_leaves_nothing_resume_would_pick() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 1);

    let half_written: RoleWriter = Box::new(|dir: &Path| {
        fs::write(dir.join("shard-0.bin"), "partial")?;
        Err("disk quota exceeded".into())
    });
    let err = ckpt
        .save(
            2,
            vec![(Role::Actor, writer("a")), (Role::Critic, half_written)],
            None,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(err, CheckpointError::WriterFailed { step: 2, ref role, .. } if role == "critic")
    );
    let msg = err.to_string();
    assert!(
        msg.contains("critic") && msg.contains("global_step_2") && msg.contains("disk quota"),
        "{msg}"
    );

    assert_eq!(names(tmp.path()), ["global_step_1", TRACKER_FILE]);
    assert_eq!(resumed_step(&ckpt), Some(1));
}

#[test]
fn panicking_writer_is_reported_and_discarded() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 1);

    let mut pending = ckpt.begin(2).unwrap();
    pending.write_role(Role::Actor, writer("a")).unwrap();
    let err = pending
        .write_role(Role::Critic, |dir: &Path| {
            fs::write(dir.join("x"), "x")?;
            panic!("CUDA error: an illegal memory access")
        })
        .unwrap_err();
    assert!(err.to_string().contains("illegal memory access"), "{err}");
    assert!(!pending.dir().exists(), "temp folder is removed at once");
    let err = pending.commit().unwrap_err();
    assert!(
        matches!(err, CheckpointError::Discarded { step: 2, .. }),
        "{err}"
    );

    assert_eq!(names(tmp.path()), ["global_step_1", TRACKER_FILE]);
    assert_eq!(resumed_step(&ckpt), Some(1));
}

#[test]
fn kill_between_write_and_rename_resumes_previous_step_and_next_save_cleans_up() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 1);

    // A process killed mid-save runs no destructor: forget the pending checkpoint to leave its folder behind.
    let mut pending = ckpt.begin(2).unwrap();
    pending.write_role(Role::Actor, writer("a")).unwrap();
    let leftover = pending.dir().to_path_buf();
    std::mem::forget(pending);
    // And one from an earlier process that is long gone (pid far above pid_max).
    let dead = tmp.path().join(".global_step_2.tmp-4294967295");
    fs::create_dir_all(dead.join("actor")).unwrap();
    // And a tracker update killed before its rename.
    fs::write(
        tmp.path()
            .join(".latest_checkpointed_iteration.txt.tmp-4294967295"),
        "2",
    )
    .unwrap();
    assert!(leftover.exists());

    assert_eq!(resumed_step(&ckpt), Some(1));

    save_step(&ckpt, 2);
    assert_eq!(
        names(tmp.path()),
        ["global_step_1", "global_step_2", TRACKER_FILE]
    );
    assert_eq!(resumed_step(&ckpt), Some(2));
}

#[test]
fn complete_folder_not_yet_named_by_tracker_is_not_picked() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 1);
    save_step(&ckpt, 2);
    // Simulate a kill right after the rename of step 2: the tracker still names step 1.
    fs::write(tmp.path().join(TRACKER_FILE), "1").unwrap();
    assert_eq!(resumed_step(&ckpt), Some(1));
}

#[test]
fn live_process_temp_folders_are_left_alone() {
    let tmp = tempfile::tempdir().unwrap();
    // pid 1 is always alive; the folder is another process's save in progress.
    let busy = tmp.path().join(".global_step_9.tmp-1");
    fs::create_dir_all(&busy).unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 1);
    assert!(busy.exists());
}

#[test]
fn tracker_naming_missing_folder_starts_fresh_with_a_note() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 4);
    fs::remove_dir_all(tmp.path().join("global_step_4")).unwrap();
    assert!(matches!(
        ckpt.find_latest().unwrap(),
        Latest::Missing { global_step: 4, .. }
    ));
    match resume(&ckpt, &ResumeMode::Auto) {
        ResumeDecision::Fresh { note: Some(note) } => {
            assert!(
                note.contains("global_step_4") && note.contains("does not exist"),
                "{note}"
            )
        }
        other => panic!("expected a fresh start with a note, got {other:?}"),
    }
}

#[test]
fn garbage_tracker_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join(TRACKER_FILE), "step five").unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    let err = ckpt.resolve_resume(&ResumeMode::Auto).unwrap_err();
    assert!(matches!(err, CheckpointError::BadTracker { .. }));
    assert!(err.to_string().contains(TRACKER_FILE) && err.to_string().contains("step five"));
}

#[test]
fn keep_n_prunes_each_role_and_then_empty_step_folders() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::from_verl(Some(2), Some(3)));
    for step in 1..=3 {
        save_step(&ckpt, step);
    }
    // Actor kept in the 2 newest, critic in the 3 newest.
    assert!(!tmp.path().join("global_step_1/actor").exists());
    assert!(tmp.path().join("global_step_1/critic").exists());
    assert!(tmp.path().join("global_step_2/actor").exists());

    let data = json!({});
    let saved = ckpt
        .save(
            4,
            vec![(Role::Actor, writer("a")), (Role::Critic, writer("c"))],
            Some(&data),
            None,
        )
        .unwrap();
    // Step 1 lost its critic too, so the whole folder went; step 2 lost its actor only.
    assert_eq!(
        saved.pruned,
        vec![
            tmp.path().join("global_step_2/actor"),
            tmp.path().join("global_step_1")
        ]
    );
    assert_eq!(
        names(tmp.path()),
        [
            "global_step_2",
            "global_step_3",
            "global_step_4",
            TRACKER_FILE
        ]
    );
    assert_eq!(
        names(&tmp.path().join("global_step_2")),
        ["critic", "data.json", "trainer_state.json"]
    );
}

#[test]
fn keep_one_keeps_only_the_latest_and_keep_all_keeps_everything() {
    let tmp = tempfile::tempdir().unwrap();
    let one = CheckpointManager::new(
        tmp.path().join("one"),
        KeepPolicy::from_verl(Some(1), Some(1)),
    );
    let all = CheckpointManager::new(
        tmp.path().join("all"),
        KeepPolicy::from_verl(Some(-1), None),
    );
    for step in [5, 10, 15] {
        save_step(&one, step);
        save_step(&all, step);
    }
    assert_eq!(names(one.root()), ["global_step_15", TRACKER_FILE]);
    assert_eq!(names(all.root()).len(), 4);
}

#[test]
fn pruning_never_touches_steps_after_the_one_saved() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::from_verl(Some(2), Some(2)));
    save_step(&ckpt, 1);
    save_step(&ckpt, 9);
    // Resume from step 1 on purpose and go on: step 9 belongs to an abandoned timeline.
    let point = resume(
        &ckpt,
        &ResumeMode::ResumePath(tmp.path().join("global_step_1")),
    );
    assert!(matches!(point, ResumeDecision::Resume(ref p) if p.global_step == 1));
    save_step(&ckpt, 2);
    save_step(&ckpt, 3);
    assert_eq!(
        names(tmp.path()),
        [
            "global_step_2",
            "global_step_3",
            "global_step_9",
            TRACKER_FILE
        ]
    );
    assert_eq!(resumed_step(&ckpt), Some(3));
}

#[test]
fn resaving_an_existing_step_replaces_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    ckpt.save(3, vec![(Role::Actor, writer("old"))], None, None)
        .unwrap();
    ckpt.save(3, vec![(Role::Actor, writer("new"))], None, None)
        .unwrap();
    assert_eq!(
        fs::read_to_string(tmp.path().join("global_step_3/actor/model.bin")).unwrap(),
        "new"
    );
    assert_eq!(names(tmp.path()), ["global_step_3", TRACKER_FILE]);
}

#[test]
fn resume_path_loads_the_named_step_and_rejects_bad_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    save_step(&ckpt, 7);
    save_step(&ckpt, 8);
    let at = |p: PathBuf| ckpt.resolve_resume(&ResumeMode::ResumePath(p));

    match at(tmp.path().join("global_step_7")).unwrap() {
        ResumeDecision::Resume(p) => {
            assert_eq!((p.global_step, p.data_state), (7, Some(json!({"step": 7}))))
        }
        other => panic!("{other:?}"),
    }

    let missing = at(tmp.path().join("global_step_70")).unwrap_err();
    assert!(
        missing.to_string().contains("global_step_70")
            && missing.to_string().contains("nothing there")
    );

    let not_step = at(tmp.path().join("global_step_7/actor")).unwrap_err();
    assert!(matches!(
        not_step,
        CheckpointError::ResumePathInvalid { .. }
    ));
    assert!(
        not_step
            .to_string()
            .contains("`actor` that is not `global_step_N`"),
        "{not_step}"
    );

    fs::write(tmp.path().join("global_step_99"), "").unwrap();
    let file = at(tmp.path().join("global_step_99")).unwrap_err();
    assert!(
        file.to_string().contains("a file, not a directory"),
        "{file}"
    );

    let bad_json = tmp.path().join("global_step_8/data.json");
    fs::write(&bad_json, "{not json").unwrap();
    let err = at(tmp.path().join("global_step_8")).unwrap_err();
    assert!(
        matches!(err, CheckpointError::Json { ref path, .. } if path == &bad_json),
        "{err}"
    );
}

#[test]
fn resume_mode_strings_follow_verl() {
    assert_eq!(
        ResumeMode::from_verl("auto", None).unwrap(),
        ResumeMode::Auto
    );
    assert_eq!(
        ResumeMode::from_verl("resume_path", Some("ckpts/global_step_3")).unwrap(),
        ResumeMode::ResumePath("ckpts/global_step_3".into())
    );
    assert!(matches!(
        ResumeMode::from_verl("resume_path", None),
        Err(CheckpointError::ResumePathUnset)
    ));
    let err = ResumeMode::from_verl("latest", None).unwrap_err();
    assert!(err.to_string().contains("`latest`") && err.to_string().contains("resume_path"));
}

#[test]
fn pruned_role_is_reported_when_required() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::from_verl(Some(1), None));
    save_step(&ckpt, 1);
    save_step(&ckpt, 2);
    let ResumeDecision::Resume(p) = resume(
        &ckpt,
        &ResumeMode::ResumePath(tmp.path().join("global_step_1")),
    ) else {
        panic!()
    };
    assert!(p.role_dir(Role::Critic).is_some());
    let err = p.require_role(Role::Actor).unwrap_err();
    assert!(
        err.to_string().contains("global_step_1") && err.to_string().contains("actor"),
        "{err}"
    );
}

#[test]
fn duplicate_entries_in_one_checkpoint_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = CheckpointManager::new(tmp.path(), KeepPolicy::default());
    let mut pending = ckpt.begin(1).unwrap();
    pending.write_json("data.json", &json!(1)).unwrap();
    let err = pending.write_json("data.json", &json!(2)).unwrap_err();
    assert!(matches!(
        err,
        CheckpointError::DuplicateEntry { step: 1, .. }
    ));
    drop(pending);
    assert!(
        names(tmp.path()).is_empty(),
        "an uncommitted checkpoint is removed on drop"
    );
}
