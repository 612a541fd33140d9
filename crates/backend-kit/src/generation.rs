//! A generate call as every backend runs it: the prompts and the sampling parameters from the
//! call's batch and options, and the engine's output as the batch the host expects.

use tch::{Device, Kind, Tensor};
use verl_plugin_api::{col, Batch, GenerateOptions};
use verl_rollout::{FinishReason, Generation, SamplingParams};

use crate::data::{column, to_f32_vec};
use crate::error::{Result, TorchContext};

/// One generate call's prompts on the device and its sampling parameters.
pub struct GenerateCall {
    /// `[prompts, P]` left-padded prompt ids and their mask.
    pub ids: Tensor,
    pub mask: Tensor,
    pub params: SamplingParams,
    /// Per-prompt request seeds in place of those `params.seed` and `row_offset` give (a share of
    /// a larger batch: [`crate::hybrid::share`]).
    pub request_seeds: Option<Vec<u64>>,
}

impl GenerateCall {
    /// `model_eos`: the model's end-of-sequence ids, used when the call names none; `seed`: the
    /// call's, else one derived from the role's seed and its call count ([`derive_seed`]).
    pub fn new(
        prompts: &Batch,
        o: &GenerateOptions,
        device: Device,
        model_eos: &[i64],
        seed: u64,
    ) -> Result<GenerateCall> {
        const CALL: &str = "Actor.generate";
        let eos_token_ids = match o.eos_token_ids.is_empty() {
            true => model_eos.to_vec(),
            false => o.eos_token_ids.clone(),
        };
        Ok(GenerateCall {
            ids: column::<i64>(prompts, CALL, col::PROMPTS, device)?,
            mask: column::<i64>(prompts, CALL, col::PROMPT_MASK, device)?,
            params: SamplingParams {
                n: o.n.max(1) as usize,
                max_new_tokens: o.max_new_tokens as usize,
                temperature: o.temperature,
                top_p: o.top_p,
                top_k: o.top_k,
                do_sample: o.do_sample,
                seed: Some(o.seed.unwrap_or(seed)),
                row_offset: o.row_offset,
                eos_token_ids,
                pad_token_id: o.pad_token_id,
                ignore_eos: o.ignore_eos,
                return_log_probs: o.return_log_probs,
            },
            request_seeds: None,
        })
    }

    /// Runs the generation engine on `model` with the call's prompts and parameters under `config`
    /// (no autograd); with a `driver`, as conversations whose turns it continues
    /// ([`verl_rollout::generate_turns`]).
    pub fn run(
        &self,
        model: &verl_nn::Transformer,
        config: &verl_rollout::EngineConfig,
        driver: Option<&mut dyn verl_plugin_api::turns::TurnDriver>,
    ) -> Result<(Generation, verl_rollout::GenerationStats)> {
        tch::no_grad(|| match driver {
            None => verl_rollout::generate_with_config(
                model,
                &self.ids,
                &self.mask,
                &self.params,
                self.request_seeds.as_deref(),
                config,
            ),
            Some(d) => verl_rollout::generate_turns(
                model,
                &self.ids,
                &self.mask,
                &self.params,
                self.request_seeds.as_deref(),
                config,
                &mut Bridge(d),
            ),
        })
        .map_err(|e| {
            crate::BackendError::Api(verl_plugin_api::Error::failed(format!("generation: {e}")))
        })
    }

    /// The engine's output as the host's batch: each response row with its prompt repeated, the
    /// masks, the prompt index, the rollout log-probs when asked for, the finish reasons, and the
    /// engine's metrics in `meta`.
    pub fn into_batch(
        self,
        gen: &Generation,
        meta: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Batch> {
        let rows = gen.prompt_index.len();
        let index = Tensor::f_from_slice(&gen.prompt_index)
            .and_then(|t| t.f_to_device(self.ids.device()))
            .ctx("prompt index")?;
        let mut out = Batch::new();
        let pl = self.ids.size()[1] as usize;
        let rl = self.params.max_new_tokens;
        out.insert_tensor(
            col::PROMPTS,
            &[rows, pl],
            &i64_vec(&self.ids.f_index_select(0, &index).ctx("repeat prompts")?)?,
        );
        out.insert_tensor(
            col::PROMPT_MASK,
            &[rows, pl],
            &i64_vec(&self.mask.f_index_select(0, &index).ctx("repeat masks")?)?,
        );
        out.insert_tensor(col::RESPONSES, &[rows, rl], &i64_vec(&gen.responses)?);
        out.insert_tensor(
            col::RESPONSE_MASK,
            &[rows, rl],
            &i64_vec(&gen.response_mask)?,
        );
        if let Some(sampled) = &gen.sampled_mask {
            out.insert_tensor(col::LOSS_MASK, &[rows, rl], &i64_vec(sampled)?);
        }
        out.insert_tensor(col::PROMPT_INDEX, &[rows], &gen.prompt_index);
        if let Some(lp) = &gen.log_probs {
            out.insert_tensor(
                col::ROLLOUT_LOG_PROBS,
                &[rows, rl],
                &to_f32_vec(lp, "rollout log-probs")?,
            );
        }
        let reasons: Vec<&str> = gen
            .finish_reasons
            .iter()
            .map(|r| match r {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            })
            .collect();
        out.insert_strings(col::FINISH_REASON, &reasons);
        out.set_meta(meta);
        Ok(out)
    }
}

/// The host's turn driver (across the ABI) as the engine's.
struct Bridge<'a>(&'a mut dyn verl_plugin_api::turns::TurnDriver);

impl verl_rollout::TurnDriver for Bridge<'_> {
    fn turns(
        &mut self,
        ended: Vec<verl_rollout::TurnEnd>,
        idle: bool,
    ) -> verl_rollout::Result<Vec<verl_rollout::Resume>> {
        use verl_plugin_api::turns::{Resume, TurnEnd};
        let ended = ended
            .into_iter()
            .map(|e| TurnEnd {
                row: e.row,
                tokens: e.tokens,
                stopped: e.finish == FinishReason::Stop,
                waits: e.waits,
                response_len: e.response_len,
            })
            .collect();
        let answers = self
            .0
            .turns(ended, idle)
            .map_err(|e| verl_rollout::RolloutError::Driver(e.to_string()))?;
        Ok(answers
            .into_iter()
            .map(|a| match a {
                Resume::Continue { row, tokens } => verl_rollout::Resume::Continue { row, tokens },
                Resume::Finish { row } => verl_rollout::Resume::Finish { row },
            })
            .collect())
    }
}

/// The seed of a role's `call`-th generate call without one of its own: a splitmix64 mix of the
/// role's seed and the call count, so calls differ and a resumed run repeats them.
pub fn derive_seed(base: u64, call: u64) -> u64 {
    let mut z = base
        ^ call
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A tensor's values as int64 on the host, flattened.
pub fn i64_vec(t: &Tensor) -> Result<Vec<i64>> {
    let flat = t
        .f_to_device(Device::Cpu)
        .and_then(|x| x.f_to_kind(Kind::Int64))
        .and_then(|x| x.f_contiguous())
        .and_then(|x| x.f_view([-1]))
        .ctx("tensor to host")?;
    Vec::<i64>::try_from(&flat).ctx("tensor to host")
}
