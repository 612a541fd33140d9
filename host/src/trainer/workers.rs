//! The roles a training step calls (actor, reference, critic) and the one clock its phases are
//! timed on. Each plugin phase of the step is a method here, so `verl run`'s trainer and
//! `verl bench grpo` run the same calls, keep the same columns and time them the same way.

use std::time::Instant;

use verl_metrics::Timings;
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{
    col, Batch, GenerateOptions, LogProbOptions, Metrics, Tensor, UpdateOptions, ValueOptions,
};

/// What runs when a timed phase ends, inside the phase's time. The trainer runs nothing; the
/// bench reads the device's memory there (a call that also waits for the device to finish, so
/// a phase whose outputs stay on the device is timed to its end).
pub(crate) trait PhaseEnd {
    fn phase_end(&mut self, phase: &'static str, actor: &mut ActorClient) -> anyhow::Result<()>;
}

impl PhaseEnd for () {
    fn phase_end(&mut self, _: &'static str, _: &mut ActorClient) -> anyhow::Result<()> {
        Ok(())
    }
}

/// The roles of one job, and the clock of the step in progress.
pub(crate) struct Workers<H: PhaseEnd = ()> {
    pub(crate) actor: ActorClient,
    pub(crate) reference: Option<ActorClient>,
    pub(crate) critic: Option<CriticClient>,
    /// A LoRA job's reference policy is the actor's base model (its adapters off, verl's
    /// `ref_in_actor`): `ref` asks the actor with `LogProbOptions::base_model`.
    pub(crate) ref_in_actor: bool,
    pub(crate) on_phase_end: H,
    clock: Timings,
}

/// Whatever holds the [`Workers`] times its phases with [`Timed::timed`], the one way a phase
/// gets its `timing_s/<phase>`. A phase timed twice in a step adds up.
pub(crate) trait Timed: Sized {
    type Hook: PhaseEnd;

    fn workers(&mut self) -> &mut Workers<Self::Hook>;

    /// Runs `f` as phase `phase` of the step: its wall-clock time, the phase-end hook included,
    /// is added to the phase. A failed phase records nothing (the step fails with it).
    fn timed<T>(
        &mut self,
        phase: &'static str,
        f: impl FnOnce(&mut Self) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let start = Instant::now();
        let out = f(self)?;
        let w = self.workers();
        w.on_phase_end.phase_end(phase, &mut w.actor)?;
        w.clock.add(phase, start.elapsed().as_secs_f64());
        Ok(out)
    }
}

impl<H: PhaseEnd> Timed for Workers<H> {
    type Hook = H;

    fn workers(&mut self) -> &mut Workers<H> {
        self
    }
}

impl<H: PhaseEnd> Workers<H> {
    pub(crate) fn new(
        actor: ActorClient,
        reference: Option<ActorClient>,
        critic: Option<CriticClient>,
        on_phase_end: H,
    ) -> Self {
        Workers {
            actor,
            reference,
            critic,
            ref_in_actor: false,
            on_phase_end,
            clock: Timings::new(),
        }
    }

    /// The step's phase times so far, in first-recorded order; the clock starts over.
    pub(crate) fn take_timings(&mut self) -> Timings {
        std::mem::take(&mut self.clock)
    }

    /// `gen`: the actor samples responses to `prompts`.
    pub(crate) fn generate(
        &mut self,
        prompts: &Batch,
        opts: &GenerateOptions,
    ) -> anyhow::Result<Batch> {
        self.timed("gen", |w| Ok(w.actor.generate(prompts, opts)?))
    }

    /// `gen` of a multi-turn job: the actor's conversations, continued by `driver`.
    pub(crate) fn generate_turns(
        &mut self,
        prompts: &Batch,
        opts: &GenerateOptions,
        driver: &mut dyn verl_plugin_api::turns::TurnDriver,
    ) -> anyhow::Result<Batch> {
        self.timed("gen", |w| {
            Ok(w.actor.generate_turns(prompts, opts, driver)?)
        })
    }

    /// `old_log_prob`: the actor's log-probs of the batch's responses, which become its
    /// `old_log_probs`. Returns them, and the actor's whole answer (its entropy, when asked for).
    pub(crate) fn old_log_prob(
        &mut self,
        batch: &mut Batch,
        opts: &LogProbOptions,
    ) -> anyhow::Result<(Tensor<f32>, Batch)> {
        let out = self.timed("old_log_prob", |w| {
            Ok(w.actor.compute_log_prob(batch, opts)?)
        })?;
        let call = format!("{}.actor.compute_log_prob", self.actor.plugin());
        let lp = out.tensor_in::<f32>(&call, col::LOG_PROBS)?;
        batch.insert_tensor(col::OLD_LOG_PROBS, &lp.shape, &lp.data);
        Ok((lp, out))
    }

    /// `ref`: the reference policy's log-probs of the batch's responses, kept as its
    /// `ref_log_probs`; `None` without a reference role.
    pub(crate) fn ref_log_prob(
        &mut self,
        batch: &mut Batch,
        opts: &LogProbOptions,
    ) -> anyhow::Result<Option<Tensor<f32>>> {
        if self.ref_in_actor {
            let base = LogProbOptions {
                base_model: true,
                ..opts.clone()
            };
            let out = self.timed("ref", |w| Ok(w.actor.compute_log_prob(batch, &base)?))?;
            let call = format!("{}.actor.compute_log_prob(base_model)", self.actor.plugin());
            let lp = out.tensor_in::<f32>(&call, col::LOG_PROBS)?;
            batch.insert_tensor(col::REF_LOG_PROBS, &lp.shape, &lp.data);
            return Ok(Some(lp));
        }
        if self.reference.is_none() {
            return Ok(None);
        }
        let out = self.timed("ref", |w| {
            w.reference
                .as_mut()
                .map(|r| r.compute_log_prob(batch, opts))
                .transpose()
                .map_err(Into::into)
        })?;
        let Some(out) = out else { return Ok(None) };
        let lp = out.tensor_in::<f32>("reference.compute_log_prob", col::LOG_PROBS)?;
        batch.insert_tensor(col::REF_LOG_PROBS, &lp.shape, &lp.data);
        Ok(Some(lp))
    }

    /// `values`: the critic's values of the batch's responses, kept as its `values`; `None`
    /// without a critic.
    pub(crate) fn values(&mut self, batch: &mut Batch) -> anyhow::Result<Option<Tensor<f32>>> {
        if self.critic.is_none() {
            return Ok(None);
        }
        let out = self.timed("values", |w| {
            w.critic
                .as_mut()
                .map(|c| c.compute_values(batch, &ValueOptions::default()))
                .transpose()
                .map_err(Into::into)
        })?;
        let Some(out) = out else { return Ok(None) };
        let v = out.tensor_in::<f32>("critic.compute_values", col::VALUES)?;
        batch.insert_tensor(col::VALUES, &v.shape, &v.data);
        Ok(Some(v))
    }

    /// `update_critic`: the critic's update on the batch; its metrics, `None` without a critic.
    pub(crate) fn update_critic(
        &mut self,
        batch: &Batch,
        opts: &UpdateOptions,
    ) -> anyhow::Result<Option<Metrics>> {
        if self.critic.is_none() {
            return Ok(None);
        }
        self.timed("update_critic", |w| {
            w.critic
                .as_mut()
                .map(|c| c.update(batch, opts))
                .transpose()
                .map_err(Into::into)
        })
    }

    /// `update_actor`: the actor's update on the batch; its metrics.
    pub(crate) fn update_actor(
        &mut self,
        batch: &Batch,
        opts: &UpdateOptions,
    ) -> anyhow::Result<Metrics> {
        self.timed("update_actor", |w| Ok(w.actor.update(batch, opts)?))
    }
}
