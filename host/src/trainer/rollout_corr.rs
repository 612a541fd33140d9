//! `algorithm.rollout_correction` in the loop: the checked settings (before any rank starts, so
//! `verl run --dry-run` reports a bad combination) and the decoupled-mode correction between the
//! old-log-prob pass and the advantages.

use verl_algos::{CorrectionLoss, RolloutCorrection, RolloutCorrectionKeys};
use verl_config::Config;

use super::TrainerError;

const CALC: &str = "actor_rollout_ref.rollout.calculate_log_probs";

/// The job's rollout correction, `None` when it is off (verl's default). Checks what verl checks
/// (late, or not at all) up front: the rollout's log-probs must be recorded, and bypass mode
/// trains the job's policy loss against the rollout log-probs. (verl's trainer renames the loss to
/// `bypass_mode` in its own copy of the config, which its actor workers, built before the first
/// step, never see: they run the configured `loss_mode` with the rollout log-probs as the old
/// ones, as DPPO's example script relies on. For `vanilla` that is verl's `bypass_ppo_clip`.)
pub fn rollout_correction(cfg: &Config) -> anyhow::Result<Option<RolloutCorrection>> {
    let rc = &cfg.algorithm.rollout_correction;
    let keys = RolloutCorrectionKeys {
        rollout_is: rc.rollout_is.clone(),
        rollout_is_threshold: rc.rollout_is_threshold.as_ref().map(|t| t.to_text()),
        rollout_is_batch_normalize: rc.rollout_is_batch_normalize,
        rollout_rs: rc.rollout_rs.as_ref().map(|r| r.to_vec().join(",")),
        rollout_rs_threshold: rc.rollout_rs_threshold.as_ref().map(|t| t.to_text()),
        bypass_mode: rc.bypass_mode,
        loss_type: rc.loss_type.clone(),
    };
    let Some(c) = RolloutCorrection::from_keys(&keys)? else {
        return Ok(None);
    };
    let what = if c.bypass_mode {
        "algorithm.rollout_correction.bypass_mode=true uses the rollout's log-probs as the old log-probs"
    } else {
        "algorithm.rollout_correction (rollout_is / rollout_rs) compares the old log-probs with the rollout's"
    };
    if !cfg.actor_rollout_ref.rollout.calculate_log_probs {
        return Err(TrainerError::Config {
            key: CALC,
            value: "false".into(),
            message: format!("{what}: set {CALC}=true so the rollout records them"),
        }
        .into());
    }
    if c.bypass_mode {
        let refuse = |key: &'static str, value: String, message: &str| -> anyhow::Result<()> {
            Err(TrainerError::Config {
                key,
                value,
                message: message.into(),
            }
            .into())
        };
        if c.loss == CorrectionLoss::Reinforce {
            refuse(
                "algorithm.rollout_correction.loss_type",
                "reinforce".into(),
                "bypass mode's REINFORCE loss (verl's bypass_pg_* presets) is not implemented in verl-rs; \
                 loss_type=ppo_clip is (verl's bypass_ppo_clip)",
            )?;
        }
        if let Some(is) = &rc.rollout_is {
            refuse(
                "algorithm.rollout_correction.rollout_is",
                is.clone(),
                "in bypass mode verl computes importance weights inside the loss, per micro-batch, \
                 against the current policy; verl-rs does not yet (set rollout_is=null, or \
                 bypass_mode=false for weights against the recomputed old log-probs)",
            )?;
        }
        if !c.rs.is_empty() {
            refuse(
                "algorithm.rollout_correction.rollout_rs",
                keys.rollout_rs.clone().unwrap_or_default(),
                "in bypass mode verl rejects tokens inside the loss, per micro-batch, against the \
                 current policy; verl-rs does not yet (set rollout_rs=null, or bypass_mode=false \
                 for rejection against the recomputed old log-probs)",
            )?;
        }
    }
    Ok(Some(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(overrides: &[&str]) -> anyhow::Result<Option<RolloutCorrection>> {
        let cfg = Config::from_overrides(overrides).unwrap();
        rollout_correction(&cfg)
    }

    #[test]
    fn verl_defaults_leave_it_off() {
        assert!(check(&[]).unwrap().is_none());
    }

    #[test]
    fn it_needs_the_rollout_log_probs() {
        let e = check(&["algorithm.rollout_correction.rollout_is=token"])
            .unwrap_err()
            .to_string();
        assert!(e.contains(CALC) && e.contains("rollout_is"), "{e}");
        let e = check(&["algorithm.rollout_correction.bypass_mode=true"])
            .unwrap_err()
            .to_string();
        assert!(e.contains(CALC) && e.contains("bypass_mode"), "{e}");
    }

    #[test]
    fn verl_config_forms_parse() {
        let c = check(&[
            &format!("{CALC}=true"),
            "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
            "algorithm.rollout_correction.rollout_rs=\"seq_mean_k1,token_k3\"",
            "algorithm.rollout_correction.rollout_rs_threshold=[0.999_1.001,0.01]",
        ])
        .unwrap()
        .unwrap();
        assert!(c.corrects_in_trainer());
        assert_eq!(c.rs.len(), 2);
        // A YAML list for rollout_rs and a number for the threshold.
        let c = check(&[
            &format!("{CALC}=true"),
            "algorithm.rollout_correction.rollout_rs=[seq_max_k2]",
            "algorithm.rollout_correction.rollout_rs_threshold=0.05",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.rs[0].high, 0.05);
    }

    #[test]
    fn bypass_mode_refuses_what_it_does_not_do_by_name() {
        let on = [
            format!("{CALC}=true"),
            "algorithm.rollout_correction.bypass_mode=true".to_string(),
        ];
        let with = |extra: &[&str]| {
            let mut v: Vec<&str> = on.iter().map(String::as_str).collect();
            v.extend(extra);
            check(&v).map(|c| c.map(|c| c.bypass_mode))
        };
        assert_eq!(
            with(&["algorithm.rollout_correction.loss_type=ppo_clip"]).unwrap(),
            Some(true)
        );
        for (extra, key) in [
            (
                &["algorithm.rollout_correction.loss_type=reinforce"][..],
                "loss_type=reinforce",
            ),
            (
                &["algorithm.rollout_correction.rollout_is=token"],
                "rollout_is=token",
            ),
            (
                &[
                    "algorithm.rollout_correction.rollout_rs=token_k1",
                    "algorithm.rollout_correction.rollout_rs_threshold=2",
                ],
                "rollout_rs=token_k1",
            ),
        ] {
            let e = with(extra).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("bypass"), "{extra:?}: {e}");
        }
        // Any policy loss trains against the rollout log-probs (DPPO's recommended setting).
        for mode in ["gspo", "dppo_tv", "geo_mean"] {
            let m = format!("actor_rollout_ref.actor.policy_loss.loss_mode={mode}");
            assert_eq!(with(&[m.as_str()]).unwrap(), Some(true), "{mode}");
        }
    }
}
