//! The `tracing` subscriber for the libraries' log events, on stderr. `RUST_LOG` filters them
//! (e.g. `RUST_LOG=debug`, `RUST_LOG=krasis_gpu=debug`); by default info and above show, which
//! the libraries keep to what the CLI has always printed (stage timings, warnings), in the same
//! plain form: `message`, `warning: message`, `error: message`. The options an event names are
//! written as the CLI's flags ([`crate::flags`]).

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Events as plain lines: info bare, warnings and errors with the CLI's own prefixes, debug and
/// trace with their level and the module they come from.
struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let meta = event.metadata();
        match *meta.level() {
            Level::INFO => {}
            Level::WARN => w.write_str("warning: ")?,
            Level::ERROR => w.write_str("error: ")?,
            Level::DEBUG => write!(w, "debug {}: ", meta.target())?,
            Level::TRACE => write!(w, "trace {}: ", meta.target())?,
        }
        // The libraries name their options (`GpuOptions::vram_budget`); the user reads the flags.
        let mut fields = String::new();
        ctx.field_format().format_fields(Writer::new(&mut fields), event)?;
        writeln!(w, "{}", crate::flags::with_flags(&fields))
    }
}

/// Install the subscriber; `RUST_LOG` directives that do not parse are ignored.
pub fn init() {
    let filter = EnvFilter::builder().with_default_directive(LevelFilter::INFO.into()).from_env_lossy();
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter).event_format(Plain).init();
}
