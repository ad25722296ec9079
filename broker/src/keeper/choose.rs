//! Which place keeps the broker's leases across its restart (`--keep-in`): a keeper
//! process (`--keeper PATH`), systemd's file-descriptor store, or none. `auto` takes the
//! keeper when one is named, else the fd store when systemd gave the service one (the
//! notify socket is set, and `$FDSTORE` — systemd 254 and later — says the store has room,
//! or descriptors of ours came back from it), else nothing.

use std::path::{Path, PathBuf};

/// The `--keep-in` setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KeepIn {
    /// The keeper when `--keeper` names one, else systemd's fd store when the unit has one.
    #[default]
    Auto,
    /// The keeper process at `--keeper`.
    Keeper,
    /// systemd's file-descriptor store (`FileDescriptorStoreMax=` in the unit).
    Fdstore,
    /// Nothing: a restart ends every session and frees its memory.
    None,
}

/// What the service manager told this process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SystemdEnv {
    /// `$NOTIFY_SOCKET` is set.
    pub notify_socket: bool,
    /// `$FDSTORE`: how many descriptors the store takes (systemd 254 and later).
    pub fdstore_max: Option<usize>,
}

impl SystemdEnv {
    /// This process's environment.
    pub fn from_env() -> SystemdEnv {
        SystemdEnv {
            notify_socket: std::env::var_os("NOTIFY_SOCKET").is_some(),
            fdstore_max: std::env::var("FDSTORE").ok().and_then(|v| v.parse().ok()),
        }
    }
}

/// The place chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    Keeper(PathBuf),
    FdStore,
    Nothing,
}

/// Why the setting cannot be honoured.
#[derive(Debug, thiserror::Error)]
pub enum ChooseError {
    #[error("--keep-in keeper needs --keeper PATH")]
    NoKeeper,
    #[error("--keep-in fdstore needs systemd's notify socket ($NOTIFY_SOCKET is not set: run the broker as a Type=notify unit)")]
    NoNotifySocket,
    #[error("--keep-in fdstore: the unit's file-descriptor store is off ($FDSTORE=0): set FileDescriptorStoreMax=")]
    StoreOff,
}

/// Picks the place (see the module documentation). `handed_back`: systemd handed back
/// descriptors of ours at this start.
pub fn choose(
    keep_in: KeepIn,
    keeper: Option<&Path>,
    env: &SystemdEnv,
    handed_back: bool,
) -> Result<Choice, ChooseError> {
    let store = env.notify_socket && (env.fdstore_max.is_some_and(|m| m > 0) || handed_back);
    match keep_in {
        KeepIn::Auto => Ok(match keeper {
            Some(p) => Choice::Keeper(p.to_path_buf()),
            None if store => Choice::FdStore,
            None => Choice::Nothing,
        }),
        KeepIn::Keeper => keeper
            .map(|p| Choice::Keeper(p.to_path_buf()))
            .ok_or(ChooseError::NoKeeper),
        KeepIn::Fdstore if !env.notify_socket => Err(ChooseError::NoNotifySocket),
        KeepIn::Fdstore if env.fdstore_max == Some(0) => Err(ChooseError::StoreOff),
        // An older systemd does not say the store's size: trust the operator.
        KeepIn::Fdstore => Ok(Choice::FdStore),
        KeepIn::None => Ok(Choice::Nothing),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_keeper_then_the_store_then_nothing() {
        let p = Path::new("/run/k.sock");
        let systemd = |n, m| SystemdEnv {
            notify_socket: n,
            fdstore_max: m,
        };
        let c = |k, keeper, env: SystemdEnv, back| choose(k, keeper, &env, back);
        assert_eq!(
            c(KeepIn::Auto, Some(p), systemd(true, Some(64)), false).unwrap(),
            Choice::Keeper(p.into())
        );
        assert_eq!(
            c(KeepIn::Auto, None, systemd(true, Some(64)), false).unwrap(),
            Choice::FdStore
        );
        assert_eq!(
            c(KeepIn::Auto, None, systemd(true, None), true).unwrap(),
            Choice::FdStore
        );
        // Type=notify without a store, or no systemd at all.
        assert_eq!(
            c(KeepIn::Auto, None, systemd(true, None), false).unwrap(),
            Choice::Nothing
        );
        assert_eq!(
            c(KeepIn::Auto, None, systemd(false, Some(64)), false).unwrap(),
            Choice::Nothing
        );
        assert_eq!(
            c(KeepIn::Fdstore, None, systemd(true, None), false).unwrap(),
            Choice::FdStore
        );
        assert!(matches!(
            c(KeepIn::Fdstore, None, systemd(false, None), false),
            Err(ChooseError::NoNotifySocket)
        ));
        assert!(matches!(
            c(KeepIn::Fdstore, None, systemd(true, Some(0)), false),
            Err(ChooseError::StoreOff)
        ));
        assert!(matches!(
            c(KeepIn::Keeper, None, systemd(true, Some(8)), false),
            Err(ChooseError::NoKeeper)
        ));
        assert_eq!(
            c(KeepIn::None, Some(p), systemd(true, Some(8)), true).unwrap(),
            Choice::Nothing
        );
    }
}
