use std::path::PathBuf;

/// What the loop itself rejects (plugin and crate errors pass through with context).
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error("data_source `{data_source}` routes to reward plugin `{plugin}` (plugins.reward), but no reward plugin of that name was loaded (loaded: {loaded})")]
    UnknownRewardPlugin {
        data_source: String,
        plugin: String,
        loaded: String,
    },

    #[error("reward.reward_model.model_path is a generative model (a causal LM, verl's GenRM): it cannot score rows itself. Route the data sources to a reward plugin that prompts it through the model services (plugins.reward.default / plugins.reward.routes; verl: custom_reward_function), or give a *ForSequenceClassification reward model")]
    GenerativeRmNeedsPlugin,

    #[error("reward plugin `{plugin}` returned {found} scores for {expected} rows")]
    RewardCount {
        plugin: String,
        expected: usize,
        found: usize,
    },

    #[error("reward plugin `{plugin}` returned a non-finite score {value} for row {row} (data_source `{data_source}`)")]
    RewardNotFinite {
        plugin: String,
        row: usize,
        data_source: String,
        value: f32,
    },

    #[error("{call}: column `{column}` has shape {found:?}, expected {expected}")]
    Shape {
        call: String,
        column: String,
        expected: String,
        found: Vec<usize>,
    },

    #[error("{key}={value}: {message}")]
    Config {
        key: &'static str,
        value: String,
        message: String,
    },

    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },

    #[error("rank {rank} of {world_size}: {message}")]
    Rank {
        rank: u32,
        world_size: u32,
        message: String,
    },
}
