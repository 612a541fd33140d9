//! A backend plugin built against plugin-api 0.1.0, before the reward model role and before
//! multi-turn generation: it has an upfront layout check and an actor that answers every prompt
//! with its last token.

use verl_plugin_api::{
    col, Actor, BackendPlugin, Batch, BuildInfo, GenerateOptions, InitArgs, LogProbOptions,
    PluginInfo, Result,
};

pub struct OldBackend;

struct EchoActor;

impl Actor for EchoActor {
    fn generate(&mut self, prompts: &Batch, o: &GenerateOptions) -> Result<Batch> {
        let ids = prompts.tensor::<i64>(col::PROMPTS)?;
        let mask = prompts.tensor::<i64>(col::PROMPT_MASK)?;
        let (p, n) = (ids.shape[1], o.n.max(1) as usize);
        let rows = ids.shape[0] * n;
        // Row r answers prompt r / n.
        let repeat = |d: &[i64]| -> Vec<i64> {
            (0..rows).flat_map(|r| d[(r / n) * p..(r / n + 1) * p].to_vec()).collect()
        };
        let mut b = Batch::new();
        b.insert_tensor(col::PROMPTS, &[rows, p], &repeat(&ids.data));
        b.insert_tensor(col::PROMPT_MASK, &[rows, p], &repeat(&mask.data));
        let first: Vec<i64> = (0..rows).map(|r| ids.data[(r / n) * p + p - 1]).collect();
        b.insert_tensor(col::RESPONSES, &[rows, 1], &first);
        b.insert_tensor(col::RESPONSE_MASK, &[rows, 1], &vec![1i64; rows]);
        let index: Vec<i64> = (0..rows).map(|r| (r / n) as i64).collect();
        b.insert_tensor(col::PROMPT_INDEX, &[rows], &index);
        Ok(b)
    }
    fn compute_log_prob(&mut self, _: &Batch, _: &LogProbOptions) -> Result<Batch> {
        Err(verl_plugin_api::Error::not_implemented("log-probs"))
    }
}

impl BackendPlugin for OldBackend {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "old_api_backend".into(),
            version: "0.1.0".into(),
            description: "an echo actor (built against plugin-api 0.1.0)".into(),
            capabilities: vec![],
            build: BuildInfo::plain(),
        }
    }
    fn validate(_: &InitArgs) -> Option<Result<String>> {
        Some(Ok("old backend: layout fits".into()))
    }
    fn create_actor(_: &InitArgs) -> Result<Box<dyn Actor>> {
        Ok(Box::new(EchoActor))
    }
}

verl_plugin_api::export_backend_plugin!(OldBackend);
