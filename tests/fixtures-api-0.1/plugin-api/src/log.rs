//! Forwarding a plugin's `tracing` events to the host: each cdylib has its own `tracing`
//! dispatcher, so without this a plugin's logs would vanish.

use std::fmt::Write as _;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

use crate::ffi::{level, HostCallbacks};

struct Forward {
    host: HostCallbacks,
    plugin: String,
}

#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={}", field.name(), value);
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={:?}", field.name(), value);
        }
    }
}

pub(crate) fn level_code(l: &Level) -> u8 {
    match *l {
        Level::ERROR => level::ERROR,
        Level::WARN => level::WARN,
        Level::INFO => level::INFO,
        Level::DEBUG => level::DEBUG,
        Level::TRACE => level::TRACE,
    }
}

impl<S: Subscriber> Layer<S> for Forward {
    fn enabled(&self, meta: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        level_code(meta.level()) <= self.host.max_level
    }
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let code = level_code(meta.level());
        if code > self.host.max_level {
            return;
        }
        let mut f = Fields::default();
        event.record(&mut f);
        let text = format!("{}{}", f.message, f.rest);
        (self.host.log)(
            code,
            self.plugin.as_str().into(),
            meta.target().into(),
            text.as_str().into(),
        );
    }
}

/// Make this plugin's global `tracing` subscriber forward to the host. A no-op if the plugin
/// already has one (e.g. when it runs in-process under `testing`).
pub(crate) fn install_forwarder(host: HostCallbacks, plugin: &str) {
    let layer = Forward {
        host,
        plugin: plugin.to_string(),
    };
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer));
}

/// The host's side: callbacks that re-emit plugin events into the host's `tracing` subscriber
/// under the target `verl::plugin`, with the plugin name as a field.
pub fn forward_to_tracing(max_level: u8) -> HostCallbacks {
    HostCallbacks {
        max_level,
        log: host_log,
    }
}

extern "C" fn host_log(
    lvl: u8,
    plugin: abi_stable::std_types::RStr<'_>,
    target: abi_stable::std_types::RStr<'_>,
    message: abi_stable::std_types::RStr<'_>,
) {
    let (plugin, target, message) = (plugin.as_str(), target.as_str(), message.as_str());
    match lvl {
        level::ERROR => {
            tracing::error!(target: "verl::plugin", plugin, source = target, "{message}")
        }
        level::WARN => tracing::warn!(target: "verl::plugin", plugin, source = target, "{message}"),
        level::INFO => tracing::info!(target: "verl::plugin", plugin, source = target, "{message}"),
        level::DEBUG => {
            tracing::debug!(target: "verl::plugin", plugin, source = target, "{message}")
        }
        _ => tracing::trace!(target: "verl::plugin", plugin, source = target, "{message}"),
    }
}

/// The most verbose level the host's current subscriber wants, as a [`level`] code.
pub fn current_max_level() -> u8 {
    match tracing::level_filters::LevelFilter::current().into_level() {
        None => 0,
        Some(l) => level_code(&l),
    }
}
