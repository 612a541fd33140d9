//! A reward plugin built against plugin-api 0.1.0 before model services: scores each response
//! by its length in characters.

use verl_plugin_api::{
    col, Batch, BuildInfo, Capability, InitArgs, PluginInfo, Result, Reward, RewardPlugin, Role,
    ScoreOptions,
};

pub struct OldReward;
struct Len;

impl RewardPlugin for OldReward {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "old_api_reward".into(),
            version: "0.1.0".into(),
            description: "response length (built against plugin-api 0.1.0)".into(),
            capabilities: vec![Capability::ready(Role::Reward)],
            build: BuildInfo::plain(),
        }
    }
    fn create_reward(_: &InitArgs) -> Result<Box<dyn Reward>> {
        Ok(Box::new(Len))
    }
}

impl Reward for Len {
    fn score(&mut self, batch: &Batch, _: &ScoreOptions) -> Result<Batch> {
        let s: Vec<f32> = batch
            .strings(col::RESPONSE_TEXT)?
            .iter()
            .map(|t| t.chars().count() as f32)
            .collect();
        let mut out = Batch::new();
        out.insert_tensor(col::SCORES, &[s.len()], &s);
        Ok(out)
    }
}

verl_plugin_api::export_reward_plugin!(OldReward);
