//! Where the loop's roles come from: plugins the host loaded from shared libraries, or plugin
//! types linked into this process (tests, embedders) run through the same ABI adapters.

use std::marker::PhantomData;

use verl_plugin_api::client::{ActorClient, CriticClient, RewardClient, RewardModelClient};
use verl_plugin_api::sdk::{BackendPlugin, RewardPlugin};
use verl_plugin_api::services::services_box;
use verl_plugin_api::{testing, InitArgs, PluginHeader, PluginKind, Role};

use crate::loader::LoadedPlugin;
use crate::models::SharedModels;

/// Creates the actor, reference and critic roles of one backend.
pub trait BackendFactory {
    fn name(&self) -> &str;
    /// Whether the backend's `role` declares `feature` (`Capability::features`).
    fn supports(&self, role: Role, feature: &str) -> bool;
    fn create_actor(&self, init: &InitArgs) -> anyhow::Result<ActorClient>;
    fn create_reference(&self, init: &InitArgs) -> anyhow::Result<ActorClient>;
    fn create_critic(&self, init: &InitArgs) -> anyhow::Result<CriticClient>;
    /// The reward model role (`init.extra.reward_model` says which model).
    fn create_reward_model(&self, init: &InitArgs) -> anyhow::Result<RewardModelClient>;
}

/// Creates a reward role, lending it the job's models.
pub trait RewardFactory {
    fn name(&self) -> &str;
    /// The plugin's library, for running it in a worker process (`plugins.reward.isolate`);
    /// `None` for a plugin linked into this process.
    fn library(&self) -> Option<&std::path::Path> {
        None
    }
    fn create_reward(&self, init: &InitArgs, models: &SharedModels)
        -> anyhow::Result<RewardClient>;
}

impl BackendFactory for LoadedPlugin {
    fn name(&self) -> &str {
        &self.header.name
    }
    fn supports(&self, role: Role, feature: &str) -> bool {
        self.header.supports(role, feature)
    }
    fn create_actor(&self, init: &InitArgs) -> anyhow::Result<ActorClient> {
        LoadedPlugin::create_actor(self, init)
    }
    fn create_reference(&self, init: &InitArgs) -> anyhow::Result<ActorClient> {
        LoadedPlugin::create_reference(self, init)
    }
    fn create_critic(&self, init: &InitArgs) -> anyhow::Result<CriticClient> {
        LoadedPlugin::create_critic(self, init)
    }
    fn create_reward_model(&self, init: &InitArgs) -> anyhow::Result<RewardModelClient> {
        LoadedPlugin::create_reward_model(self, init)
    }
}

impl RewardFactory for LoadedPlugin {
    fn name(&self) -> &str {
        &self.header.name
    }
    fn library(&self) -> Option<&std::path::Path> {
        Some(&self.path)
    }
    fn create_reward(
        &self,
        init: &InitArgs,
        models: &SharedModels,
    ) -> anyhow::Result<RewardClient> {
        LoadedPlugin::create_reward(self, init, Some(services_box(models.clone())))
    }
}

/// A backend plugin type linked into this process.
pub struct InProcessBackend<P> {
    name: String,
    _plugin: PhantomData<fn() -> P>,
}

impl<P: BackendPlugin> Default for InProcessBackend<P> {
    fn default() -> Self {
        InProcessBackend {
            name: P::info().name,
            _plugin: PhantomData,
        }
    }
}

impl<P: BackendPlugin> BackendFactory for InProcessBackend<P> {
    fn name(&self) -> &str {
        &self.name
    }
    fn supports(&self, role: Role, feature: &str) -> bool {
        PluginHeader::from_info(P::info(), PluginKind::Backend).supports(role, feature)
    }
    fn create_actor(&self, init: &InitArgs) -> anyhow::Result<ActorClient> {
        Ok(testing::actor::<P>(init)?)
    }
    fn create_reference(&self, init: &InitArgs) -> anyhow::Result<ActorClient> {
        Ok(testing::reference::<P>(init)?)
    }
    fn create_critic(&self, init: &InitArgs) -> anyhow::Result<CriticClient> {
        Ok(testing::critic::<P>(init)?)
    }
    fn create_reward_model(&self, init: &InitArgs) -> anyhow::Result<RewardModelClient> {
        Ok(testing::reward_model::<P>(init)?)
    }
}

/// A reward plugin type linked into this process.
pub struct InProcessReward<P> {
    name: String,
    _plugin: PhantomData<fn() -> P>,
}

impl<P: RewardPlugin> Default for InProcessReward<P> {
    fn default() -> Self {
        InProcessReward {
            name: P::info().name,
            _plugin: PhantomData,
        }
    }
}

impl<P: RewardPlugin> RewardFactory for InProcessReward<P> {
    fn name(&self) -> &str {
        &self.name
    }
    fn create_reward(
        &self,
        init: &InitArgs,
        models: &SharedModels,
    ) -> anyhow::Result<RewardClient> {
        Ok(testing::reward_with::<P>(init, models.clone())?)
    }
}

/// The plugins of one job: the backend, and reward plugins under the names `plugins.reward`
/// routes to (`plugins.reward.default`, `plugins.reward.routes.<data_source>`).
pub struct JobPlugins {
    pub backend: Box<dyn BackendFactory>,
    pub rewards: Vec<(String, Box<dyn RewardFactory>)>,
    /// Where a multi-turn job's tool classes are looked for.
    pub tools: crate::tools::ToolPlugins,
}

impl JobPlugins {
    /// Plugins the host loaded (`Loader::load`).
    pub fn new(backend: LoadedPlugin, rewards: Vec<(String, LoadedPlugin)>) -> Self {
        JobPlugins {
            backend: Box::new(backend),
            rewards: rewards
                .into_iter()
                .map(|(n, p)| (n, Box::new(p) as Box<dyn RewardFactory>))
                .collect(),
            tools: crate::tools::ToolPlugins::default(),
        }
    }

    /// Any mix of loaded and in-process plugins.
    pub fn from_factories(
        backend: Box<dyn BackendFactory>,
        rewards: Vec<(String, Box<dyn RewardFactory>)>,
    ) -> Self {
        JobPlugins {
            backend,
            rewards,
            tools: crate::tools::ToolPlugins::default(),
        }
    }

    /// Where the tool config's classes are looked for (`--plugin` tool plugins, search path).
    pub fn with_tools(mut self, tools: crate::tools::ToolPlugins) -> Self {
        self.tools = tools;
        self
    }

    /// Adds a reward plugin under routing name `name`.
    pub fn with_reward(mut self, name: impl Into<String>, reward: Box<dyn RewardFactory>) -> Self {
        self.rewards.push((name.into(), reward));
        self
    }
}
