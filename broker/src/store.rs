//! Durable broker state: tenants (quotas, priorities, guarantees), API tokens (only
//! their hashes) and Kubernetes claims' reservations in one embedded, transactional [`redb`] database file,
//! `<state dir>/state.redb`.
//!
//! The store owns the file and its format, nothing else: the ledger loads everything at
//! start-up with [`Store::load`] and writes each change through with one of the `put_*` /
//! `delete_*` methods, each of which is its own write transaction, committed with fsync
//! before it returns.
//!
//! Layout (schema version [`SCHEMA_VERSION`]): tables keyed by `&str`, whose values are
//! JSON documents (`claims` is made by the first claim: a file without it has none):
//!
//! | table     | key        | value                          |
//! | --------- | ---------- | ------------------------------ |
//! | `meta`    | `"schema"` | the schema version, JSON `1`   |
//! | `tenants` | name       | [`TenantRecord`]               |
//! | `tokens`  | token_id   | [`TokenRecord`]                |
//! | `claims`  | claim uid  | [`ClaimRecord`]                |
//!
//! Safety of the operator's data comes first:
//! * a new file is built and committed under a temporary name and only then linked into
//!   place (never replacing anything), so a crash while creating it leaves no half-made
//!   `state.redb` behind;
//! * an existing file is first opened read-only, which never writes, and is checked (it is
//!   a redb database, it is a gpu-broker state file, its schema is one this build knows)
//!   before it is opened for writing. A file that fails any of this is reported as an
//!   error ([`StoreError::Corrupt`], [`StoreError::Unreadable`],
//!   [`StoreError::UnsupportedSchema`]) and is never overwritten, repaired or recreated;
//! * the writable open verifies the checksum of every page (redb's integrity check), so
//!   corruption is reported rather than trusted;
//! * every commit uses redb's quick-repair mode (2-phase commit plus saved allocator
//!   state), so a broker killed mid-write reopens without a repair pass.
//!
//! The store does not check references between records: a token may name a tenant that
//! is not stored (the ledger decides what tokens mean); [`Store::delete_tenant`] removes
//! every token whose `tenant` is the deleted name.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::quota::Quota;

use redb::{
    Database, DatabaseError, ReadableDatabase, ReadableTable, StorageError, TableDefinition,
    TableError,
};

/// File name of the state database inside the state directory.
pub const STATE_FILE_NAME: &str = "state.redb";

/// Schema version this build writes and reads. A file with a newer version is refused.
pub const SCHEMA_VERSION: u64 = 1;

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const TENANTS: TableDefinition<&str, &[u8]> = TableDefinition::new("tenants");
const TOKENS: TableDefinition<&str, &[u8]> = TableDefinition::new("tokens");
const CLAIMS: TableDefinition<&str, &[u8]> = TableDefinition::new("claims");
const SCHEMA_KEY: &str = "schema";

/// redb page cache for this (small) file.
const CACHE_BYTES: usize = 16 * 1024 * 1024;

/// A tenant and its quota, as persisted: the quota's fields sit beside the name (the
/// JSON `{"name": .., "limit_bytes": .., ...}`), so the file format is
/// [`Quota`]'s serde form.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TenantRecord {
    pub name: String,
    #[serde(flatten)]
    pub quota: Quota,
}

/// An API token, as persisted (only the hash of the secret): the authenticator's own
/// record, [`crate::auth::TokenEntry`], in its serde form.
pub type TokenRecord = crate::auth::TokenEntry;

/// A Kubernetes claim's reservation, as persisted: a restarted broker takes it again
/// with the same id, so the claim's pod keeps its room and its token keeps drawing from it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClaimRecord {
    /// The ResourceClaim's uid (the key).
    pub uid: String,
    pub reservation_id: String,
    pub tenant: String,
    pub device: u32,
    /// The device's UUID when reserved: a restart that finds another device at that
    /// index does not take the reservation again.
    pub device_uuid: String,
    /// Rounded to the device's granularity.
    pub bytes: u64,
    pub label: String,
    /// The worker token bound to it (a record whose token is gone is stale).
    pub token_id: String,
    pub created_unix_ms: u64,
}

/// Errors of the state store. Every variant names the file or directory concerned.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The state directory could not be created or used.
    #[error("state directory {path}: {source}")]
    Dir { path: PathBuf, source: io::Error },

    /// The file exists but is not a readable gpu-broker redb database (garbage, truncated,
    /// failed checksum, a foreign database, an undecodable record).
    #[error(
        "state file {path} is corrupt or not a gpu-broker state database: {reason}. \
         The file was left untouched; move it aside (or restore a backup) and restart \
         to start with an empty state"
    )]
    Corrupt { path: PathBuf, reason: String },

    /// The file exists but could not be opened or read (permissions, I/O error).
    #[error(
        "state file {path} cannot be opened for reading and writing: {source}. \
         The file was left untouched; check its owner, permissions and the disk"
    )]
    Unreadable { path: PathBuf, source: io::Error },

    /// Another process (or another `Store` in this one) has the file open.
    #[error(
        "state file {path} is in use by another process; is another gpu-broker running \
         with the same state directory?"
    )]
    Locked { path: PathBuf },

    /// The database was closed after an I/O error and could not be opened again yet.
    #[error(
        "state file {path} is not writable: {reason}. The broker retries on the next change; \
         check the disk (free space, errors)"
    )]
    Unwritable { path: PathBuf, reason: String },

    /// The file was written by a newer gpu-broker with a schema this build does not know.
    #[error(
        "state file {path} has schema version {found}, newer than the version {supported} \
         this gpu-broker understands (it was written by a newer gpu-broker). \
         The file was left untouched; run a newer gpu-broker"
    )]
    UnsupportedSchema {
        path: PathBuf,
        found: u64,
        supported: u64,
    },

    /// A record cannot be stored as given (e.g. an empty key).
    #[error("state file {path}: invalid record: {reason}")]
    Invalid { path: PathBuf, reason: String },

    /// A record could not be encoded as JSON.
    #[error("state file {path}: cannot encode {what}: {source}")]
    Encode {
        path: PathBuf,
        what: String,
        source: serde_json::Error,
    },

    /// Any other database or I/O error while reading or writing the file.
    #[error("state file {path}: {op} failed: {source}")]
    Db {
        path: PathBuf,
        op: &'static str,
        source: Box<redb::Error>,
    },
}

/// The broker's durable state: an open `state.redb`, held exclusively by this process.
///
/// `Send + Sync`; every method takes `&self` (redb serialises write transactions).
pub struct Store {
    /// `None` only while a reopen after an I/O error failed (the next write retries).
    db: parking_lot::RwLock<Option<Database>>,
    path: PathBuf,
    /// False from a failed write (ENOSPC, EIO) until a write commits again.
    writable: tokio::sync::watch::Sender<bool>,
    /// Tests only: every commit fails as an I/O error would (see [`Store::fail_commits`]).
    #[cfg(test)]
    fail_commits: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

/// What a `..._with` write also writes in its transaction (an audit record; see
/// [`crate::audit::AuditLog::append_with`]).
pub type AlsoWrite<'a> = &'a dyn Fn(&redb::WriteTransaction) -> Result<(), redb::Error>;

impl Store {
    /// Opens or creates `<dir>/state.redb`; creates `dir` (mode 0700) if missing. A file
    /// that exists but cannot be read as a redb database (corrupt, truncated, garbage,
    /// wrong permissions) is an error and is NEVER overwritten or recreated.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        create_dir(dir)?;
        let path = dir.join(STATE_FILE_NAME);
        match fs::metadata(&path) {
            // redb may panic on pages corrupted outside it, also after the open itself
            // (reading the schema): that is a corrupt file, not a crash.
            Ok(_) => {
                let p = path.clone();
                no_panic(&p, "opening", move || Self::open_existing(path))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => match create_new(dir, &path)? {
                Some(store) => Ok(store),
                // Another process created it meanwhile: use theirs.
                None => Self::open_existing(path),
            },
            Err(source) => Err(StoreError::Unreadable { path, source }),
        }
    }

    /// Path of the database file, `<dir>/state.redb`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All tenants and tokens, sorted by name / token_id.
    pub fn load(&self) -> Result<(Vec<TenantRecord>, Vec<TokenRecord>), StoreError> {
        no_panic(&self.path, "loading", || self.load_unguarded())
    }

    fn load_unguarded(&self) -> Result<(Vec<TenantRecord>, Vec<TokenRecord>), StoreError> {
        let txn = self.begin_read()?;
        let tenants: Vec<TenantRecord> = {
            let table = txn
                .open_table(TENANTS)
                .map_err(|e| db_err(&self.path, "open table tenants", e))?;
            read_all(&self.path, &table, "tenant", |t: &TenantRecord| &t.name)?
        };
        let tokens: Vec<TokenRecord> = {
            let table = txn
                .open_table(TOKENS)
                .map_err(|e| db_err(&self.path, "open table tokens", e))?;
            read_all(&self.path, &table, "token", |t: &TokenRecord| &t.token_id)?
        };
        Ok((tenants, tokens))
    }

    /// Inserts or replaces the tenant named `t.name`; durable before returning.
    pub fn put_tenant(&self, t: &TenantRecord) -> Result<(), StoreError> {
        self.put_tenant_with(t, None)
    }

    /// [`Store::put_tenant`], with `also` written in the same transaction (one commit).
    pub(crate) fn put_tenant_with(
        &self,
        t: &TenantRecord,
        also: Option<AlsoWrite<'_>>,
    ) -> Result<(), StoreError> {
        self.check_key("tenant name", &t.name)?;
        let bytes = self.encode(&format!("tenant '{}'", t.name), t)?;
        let txn = self.begin_write()?;
        {
            let mut table = txn
                .open_table(TENANTS)
                .map_err(|e| db_err(&self.path, "open table tenants", e))?;
            table
                .insert(t.name.as_str(), bytes.as_slice())
                .map_err(|e| db_err(&self.path, "write tenant", e))?;
        }
        if let Some(also) = also {
            also(&txn).map_err(|e| db_err(&self.path, "write with tenant", e))?;
        }
        self.commit(txn)
    }

    /// Deletes the tenant and all its tokens in one transaction. Ok(false) if absent.
    pub fn delete_tenant(&self, name: &str) -> Result<bool, StoreError> {
        self.delete_tenant_with(name, None)
    }

    /// [`Store::delete_tenant`], with `also` written in the same transaction (one commit,
    /// made also when the tenant is absent).
    pub(crate) fn delete_tenant_with(
        &self,
        name: &str,
        also: Option<AlsoWrite<'_>>,
    ) -> Result<bool, StoreError> {
        let txn = self.begin_write()?;
        let existed = {
            let mut tenants = txn
                .open_table(TENANTS)
                .map_err(|e| db_err(&self.path, "open table tenants", e))?;
            let removed = tenants
                .remove(name)
                .map_err(|e| db_err(&self.path, "delete tenant", e))?;
            removed.is_some()
        };
        if let Some(also) = also {
            also(&txn).map_err(|e| db_err(&self.path, "write with tenant deletion", e))?;
        }
        if !existed && also.is_none() {
            txn.abort()
                .map_err(|e| db_err(&self.path, "abort write transaction", e))?;
            return Ok(false);
        }
        {
            let mut tokens = txn
                .open_table(TOKENS)
                .map_err(|e| db_err(&self.path, "open table tokens", e))?;
            let all: Vec<TokenRecord> =
                read_all(&self.path, &tokens, "token", |t: &TokenRecord| &t.token_id)?;
            for token in all.iter().filter(|t| t.tenant == name) {
                tokens
                    .remove(token.token_id.as_str())
                    .map_err(|e| db_err(&self.path, "delete token", e))?;
            }
        }
        self.commit(txn)?;
        Ok(existed)
    }

    /// Inserts or replaces the token `t.token_id`; durable before returning.
    pub fn put_token(&self, t: &TokenRecord) -> Result<(), StoreError> {
        self.put_token_with(t, None)
    }

    /// [`Store::put_token`], with `also` written in the same transaction (one commit).
    pub(crate) fn put_token_with(
        &self,
        t: &TokenRecord,
        also: Option<AlsoWrite<'_>>,
    ) -> Result<(), StoreError> {
        self.check_key("token id", &t.token_id)?;
        let bytes = self.encode(&format!("token '{}'", t.token_id), t)?;
        let txn = self.begin_write()?;
        {
            let mut table = txn
                .open_table(TOKENS)
                .map_err(|e| db_err(&self.path, "open table tokens", e))?;
            table
                .insert(t.token_id.as_str(), bytes.as_slice())
                .map_err(|e| db_err(&self.path, "write token", e))?;
        }
        if let Some(also) = also {
            also(&txn).map_err(|e| db_err(&self.path, "write with token", e))?;
        }
        self.commit(txn)
    }

    /// Deletes one token. Ok(false) if absent.
    pub fn delete_token(&self, token_id: &str) -> Result<bool, StoreError> {
        self.delete_token_with(token_id, None)
    }

    /// [`Store::delete_token`], with `also` written in the same transaction (one commit,
    /// made also when the token is absent).
    pub(crate) fn delete_token_with(
        &self,
        token_id: &str,
        also: Option<AlsoWrite<'_>>,
    ) -> Result<bool, StoreError> {
        let txn = self.begin_write()?;
        let existed = {
            let mut table = txn
                .open_table(TOKENS)
                .map_err(|e| db_err(&self.path, "open table tokens", e))?;
            let removed = table
                .remove(token_id)
                .map_err(|e| db_err(&self.path, "delete token", e))?;
            removed.is_some()
        };
        if let Some(also) = also {
            also(&txn).map_err(|e| db_err(&self.path, "write with token deletion", e))?;
        }
        if existed || also.is_some() {
            self.commit(txn)?;
        } else {
            txn.abort()
                .map_err(|e| db_err(&self.path, "abort write transaction", e))?;
        }
        Ok(existed)
    }

    /// Every claim reservation, sorted by uid (none in a file without the table).
    pub fn load_claims(&self) -> Result<Vec<ClaimRecord>, StoreError> {
        no_panic(&self.path, "loading claims", || {
            let txn = self.begin_read()?;
            let table = match txn.open_table(CLAIMS) {
                Ok(t) => t,
                Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(db_err(&self.path, "open table claims", e)),
            };
            read_all(&self.path, &table, "claim", |c: &ClaimRecord| &c.uid)
        })
    }

    /// Inserts or replaces the claim `c.uid`; durable before returning.
    pub fn put_claim(&self, c: &ClaimRecord) -> Result<(), StoreError> {
        self.check_key("claim uid", &c.uid)?;
        let bytes = self.encode(&format!("claim '{}'", c.uid), c)?;
        let txn = self.begin_write()?;
        {
            let mut table = txn
                .open_table(CLAIMS)
                .map_err(|e| db_err(&self.path, "open table claims", e))?;
            table
                .insert(c.uid.as_str(), bytes.as_slice())
                .map_err(|e| db_err(&self.path, "write claim", e))?;
        }
        self.commit(txn)
    }

    /// Deletes one claim. Ok(false) if absent.
    pub fn delete_claim(&self, uid: &str) -> Result<bool, StoreError> {
        let txn = self.begin_write()?;
        let existed = {
            let mut table = txn
                .open_table(CLAIMS)
                .map_err(|e| db_err(&self.path, "open table claims", e))?;
            let removed = table
                .remove(uid)
                .map_err(|e| db_err(&self.path, "delete claim", e))?;
            removed.is_some()
        };
        if existed {
            self.commit(txn)?;
        } else {
            txn.abort()
                .map_err(|e| db_err(&self.path, "abort write transaction", e))?;
        }
        Ok(existed)
    }

    // ---- opening ----

    /// Opens a file that already exists. Nothing is written to it until a read-only open
    /// has shown that it is a gpu-broker database of a known schema.
    fn open_existing(path: PathBuf) -> Result<Store, StoreError> {
        let meta = fs::metadata(&path).map_err(|source| StoreError::Unreadable {
            path: path.clone(),
            source,
        })?;
        if !meta.is_file() {
            return Err(StoreError::Corrupt {
                path,
                reason: "it is not a regular file".to_string(),
            });
        }
        if meta.len() == 0 {
            // redb would initialise an empty file; an empty state file is a truncated one.
            return Err(StoreError::Corrupt {
                path,
                reason: "the file is empty (0 bytes)".to_string(),
            });
        }

        // 1. Read-only: never writes, refuses (RepairAborted) a file that needs recovery.
        let preflight = guarded(&path, || {
            let mut b = redb::Builder::new();
            b.set_cache_size(CACHE_BYTES);
            b.open_read_only(&path)
        });
        match preflight {
            Ok(ro) => {
                check_schema(&path, &ro)?;
                drop(ro);
            }
            // Not shut down cleanly (killed before quick-repair state existed): the writable
            // open below repairs it, after verifying every page checksum.
            Err(DatabaseError::RepairAborted) => {}
            Err(e) => return Err(open_err(&path, e)),
        }

        // 2. Writable, verifying every page checksum on the way in.
        let db = guarded(&path, || {
            let mut b = redb::Builder::new();
            b.set_cache_size(CACHE_BYTES);
            b.set_check_integrity_on_open(true);
            b.open(&path)
        })
        .map_err(|e| open_err(&path, e))?;
        // Checked again: the file may have needed recovery, or changed between the opens.
        check_schema(&path, &db)?;
        Ok(Store::from_db(db, path))
    }

    // ---- for modules with their own tables in this file ----

    /// Runs `f` in one write transaction of the state file (quick-repair, committed with
    /// fsync before returning): for modules that keep their own tables here (`audit.rs`).
    pub(crate) fn write_with<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StoreError> {
        let txn = self.begin_write()?;
        let out = f(&txn).map_err(|e| db_err(&self.path, op, e))?;
        self.commit(txn)?;
        Ok(out)
    }

    /// Runs `f` in one read transaction of the state file.
    pub(crate) fn read_with<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, redb::Error>,
    ) -> Result<T, StoreError> {
        let txn = self.begin_read()?;
        f(&txn).map_err(|e| db_err(&self.path, op, e))
    }

    // ---- helpers ----

    fn begin_read(&self) -> Result<redb::ReadTransaction, StoreError> {
        let db = self.db.read();
        let db = db
            .as_ref()
            .ok_or_else(|| self.unwritable("closed after an I/O error"))?;
        db.begin_read()
            .map_err(|e| db_err(&self.path, "begin read transaction", e))
    }

    fn begin_write(&self) -> Result<redb::WriteTransaction, StoreError> {
        if !*self.writable.borrow() {
            // An earlier write failed (redb then refuses every transaction until the
            // database is reopened): reopen first.
            if let Err(e) = self.reopen() {
                tracing::debug!(error = %e, "state store still not reopened");
            }
        }
        let begun = {
            let db = self.db.read();
            let db = db
                .as_ref()
                .ok_or_else(|| self.unwritable("closed after an I/O error"))?;
            db.begin_write().map_err(redb::Error::from)
        };
        let mut txn = begun.map_err(|e| {
            self.note_failure(&e);
            db_err(&self.path, "begin write transaction", e)
        })?;
        // 2-phase commit and saved allocator state: no repair pass after a crash.
        txn.set_quick_repair(true);
        Ok(txn)
    }

    fn commit(&self, txn: redb::WriteTransaction) -> Result<(), StoreError> {
        #[cfg(test)]
        if self.fail_commits.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = txn.abort();
            let e = redb::Error::Io(io::Error::other("a commit failure injected by a test"));
            self.note_failure(&e);
            return Err(db_err(&self.path, "commit", e));
        }
        match txn.commit() {
            Ok(()) => {
                if self.set_writable(true) {
                    tracing::info!(path = %self.path.display(), "state store writable again");
                }
                Ok(())
            }
            Err(e) => {
                let e = redb::Error::from(e);
                self.note_failure(&e);
                Err(db_err(&self.path, "commit", e))
            }
        }
    }

    fn from_db(db: Database, path: PathBuf) -> Store {
        Store {
            db: parking_lot::RwLock::new(Some(db)),
            path,
            writable: tokio::sync::watch::Sender::new(true),
            #[cfg(test)]
            fail_commits: Default::default(),
        }
    }

    /// Tests only: from now on (`on`) every commit fails as an I/O error (EIO) would: the
    /// transaction is aborted, the store turns unwritable, the caller gets the error; with
    /// `on` false the next write reopens the database and commits as after a recovery.
    #[cfg(test)]
    pub(crate) fn fail_commits(&self, on: bool) {
        self.fail_commits
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    fn into_db(self) -> Database {
        self.db
            .into_inner()
            .expect("a store being built holds its database")
    }

    fn unwritable(&self, reason: &str) -> StoreError {
        StoreError::Unwritable {
            path: self.path.clone(),
            reason: reason.to_string(),
        }
    }

    /// Records whether the store is writable; true when that changed. Watchers (the Admin
    /// service's health) hear of changes only: a commit of a writable store, the common
    /// case, wakes nobody (a wake-up on every commit costs acquires a runtime worker's
    /// wake-up per operator write).
    fn set_writable(&self, now: bool) -> bool {
        self.writable
            .send_if_modified(|w| std::mem::replace(w, now) != now)
    }

    /// An I/O failure (ENOSPC, EIO, or redb's "previous I/O error") makes the store
    /// unwritable until a write commits again; logged once per episode.
    fn note_failure(&self, e: &redb::Error) {
        let io = matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo);
        if io && self.set_writable(false) {
            tracing::error!(
                path = %self.path.display(),
                error = %e,
                "state store unwritable: admin changes fail until it recovers (reopened on the next change)"
            );
        }
    }

    /// Closes and reopens the database (redb refuses every transaction after an I/O
    /// error until then). The file is checked as at start.
    fn reopen(&self) -> Result<(), StoreError> {
        let mut db = self.db.write();
        // Close first: the file is locked while open.
        drop(db.take());
        let p = self.path.clone();
        let fresh = no_panic(&self.path, "reopening", move || Self::open_existing(p))?;
        *db = Some(fresh.into_db());
        tracing::info!(path = %self.path.display(), "state store reopened");
        Ok(())
    }

    /// Watches whether the store is writable (false from a failed write until a write
    /// commits again).
    pub fn writable(&self) -> tokio::sync::watch::Receiver<bool> {
        self.writable.subscribe()
    }

    /// While unwritable: reopens and commits an empty transaction; returns whether the
    /// store is writable now. Cheap when it is.
    pub fn probe(&self) -> bool {
        if *self.writable.borrow() {
            return true;
        }
        match self.begin_write() {
            Ok(txn) => self.commit(txn).is_ok(),
            Err(_) => false,
        }
    }

    fn check_key(&self, what: &str, key: &str) -> Result<(), StoreError> {
        if key.is_empty() {
            return Err(StoreError::Invalid {
                path: self.path.clone(),
                reason: format!("{what} is empty"),
            });
        }
        Ok(())
    }

    fn encode<T: serde::Serialize>(&self, what: &str, value: &T) -> Result<Vec<u8>, StoreError> {
        serde_json::to_vec(value).map_err(|source| StoreError::Encode {
            path: self.path.clone(),
            what: what.to_string(),
            source,
        })
    }
}

/// Creates the state directory (mode 0700, parents as needed) if it does not exist.
fn create_dir(dir: &Path) -> Result<(), StoreError> {
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir).map_err(|source| StoreError::Dir {
        path: dir.to_path_buf(),
        source,
    })
}

/// Builds a new database under a temporary name in `dir`, commits the schema, and links
/// it to `path` only if nothing is there. `Ok(None)`: something appeared at `path`
/// meanwhile (left alone).
fn create_new(dir: &Path, path: &Path) -> Result<Option<Store>, StoreError> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(
        ".{STATE_FILE_NAME}.{}.{nanos}.tmp",
        std::process::id()
    ));
    let dir_err = |source: io::Error| StoreError::Dir {
        path: dir.to_path_buf(),
        source,
    };

    let mut opts = fs::OpenOptions::new();
    opts.read(true).write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    drop(opts.open(&tmp).map_err(dir_err)?);

    let built = (|| {
        let mut b = redb::Builder::new();
        b.set_cache_size(CACHE_BYTES);
        let db = b
            .create(&tmp)
            .map_err(|e| db_err(&tmp, "create database", e))?;
        let store = Store::from_db(db, tmp.clone());
        let txn = store.begin_write()?;
        {
            let schema = store.encode("schema version", &SCHEMA_VERSION)?;
            let mut meta = txn
                .open_table(META)
                .map_err(|e| db_err(&tmp, "create table meta", e))?;
            meta.insert(SCHEMA_KEY, schema.as_slice())
                .map_err(|e| db_err(&tmp, "write schema version", e))?;
            txn.open_table(TENANTS)
                .map_err(|e| db_err(&tmp, "create table tenants", e))?;
            txn.open_table(TOKENS)
                .map_err(|e| db_err(&tmp, "create table tokens", e))?;
        }
        store.commit(txn)?;
        Ok::<_, StoreError>(store.into_db())
    })();
    let db = match built {
        Ok(db) => db,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };

    // A hard link never replaces an existing file, unlike rename.
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            // Make the new directory entry durable too.
            fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(dir_err)?;
            Ok(Some(Store::from_db(db, path.to_path_buf())))
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(None),
        Err(source) => Err(StoreError::Dir {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Runs a redb open, turning a panic inside redb (it may panic on a file corrupted
/// outside redb) into a corruption error.
fn guarded<T>(
    path: &Path,
    f: impl FnOnce() -> Result<T, DatabaseError>,
) -> Result<T, DatabaseError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(DatabaseError::Storage(StorageError::Corrupted(format!(
                "redb panicked while opening {}: {msg}",
                path.display()
            ))))
        }
    }
}

/// Runs `f`, turning a panic inside redb into [`StoreError::Corrupt`].
fn no_panic<T>(
    path: &Path,
    what: &str,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(StoreError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("redb panicked while {what} it: {msg}"),
            })
        }
    }
}

/// Maps an error from opening an existing file.
fn open_err(path: &Path, e: DatabaseError) -> StoreError {
    let path = path.to_path_buf();
    match e {
        DatabaseError::DatabaseAlreadyOpen | DatabaseError::LockProtocolMismatch => {
            StoreError::Locked { path }
        }
        DatabaseError::UpgradeRequired(v) => StoreError::Corrupt {
            path,
            reason: format!("redb file format version {v} is not supported by this build"),
        },
        DatabaseError::Storage(StorageError::Corrupted(reason)) => {
            StoreError::Corrupt { path, reason }
        }
        DatabaseError::Storage(StorageError::Io(source)) => match source.kind() {
            // redb reports "not a redb database" as InvalidData; a short file as EOF.
            io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof => StoreError::Corrupt {
                path,
                reason: source.to_string(),
            },
            _ => StoreError::Unreadable { path, source },
        },
        other => StoreError::Db {
            path,
            op: "open database",
            source: Box::new(other.into()),
        },
    }
}

/// Maps any redb error; checksum failures and the like become [`StoreError::Corrupt`].
fn db_err(path: &Path, op: &'static str, e: impl Into<redb::Error>) -> StoreError {
    match e.into() {
        redb::Error::Corrupted(reason) => StoreError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("{op}: {reason}"),
        },
        redb::Error::DatabaseAlreadyOpen => StoreError::Locked {
            path: path.to_path_buf(),
        },
        source => StoreError::Db {
            path: path.to_path_buf(),
            op,
            source: Box::new(source),
        },
    }
}

/// Checks that the database is a gpu-broker state file of a schema this build knows.
fn check_schema(path: &Path, db: &impl ReadableDatabase) -> Result<(), StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let txn = db
        .begin_read()
        .map_err(|e| db_err(path, "begin read transaction", e))?;
    let meta = match txn.open_table(META) {
        Ok(t) => t,
        Err(TableError::TableDoesNotExist(_)) => {
            return Err(corrupt(
                "it has no 'meta' table with a schema version".to_string(),
            ))
        }
        Err(TableError::TableTypeMismatch { .. }) => {
            return Err(corrupt("its 'meta' table has the wrong type".to_string()))
        }
        Err(e) => return Err(db_err(path, "open table meta", e)),
    };
    let raw = meta
        .get(SCHEMA_KEY)
        .map_err(|e| db_err(path, "read schema version", e))?
        .ok_or_else(|| corrupt("its 'meta' table has no schema version".to_string()))?;
    let found: u64 = serde_json::from_slice(raw.value())
        .map_err(|e| corrupt(format!("unreadable schema version: {e}")))?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::UnsupportedSchema {
            path: path.to_path_buf(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    if found == 0 {
        return Err(corrupt("schema version 0 is invalid".to_string()));
    }
    for (name, def) in [("tenants", TENANTS), ("tokens", TOKENS)] {
        match txn.open_table(def) {
            Ok(_) => {}
            Err(TableError::TableDoesNotExist(_)) => {
                return Err(corrupt(format!("its '{name}' table is missing")))
            }
            Err(TableError::TableTypeMismatch { .. }) => {
                return Err(corrupt(format!("its '{name}' table has the wrong type")))
            }
            Err(e) => return Err(db_err(path, "open table", e)),
        }
    }
    Ok(())
}

/// Decodes every record of a table, in key order, checking that each key matches.
fn read_all<T, R>(
    path: &Path,
    table: &R,
    kind: &str,
    key_of: impl Fn(&T) -> &String,
) -> Result<Vec<T>, StoreError>
where
    T: serde::de::DeserializeOwned,
    R: ReadableTable<&'static str, &'static [u8]>,
{
    let mut out = Vec::new();
    let iter = table.iter().map_err(|e| db_err(path, "iterate table", e))?;
    for item in iter {
        let (k, v) = item.map_err(|e| db_err(path, "read record", e))?;
        let key = k.value();
        let record: T = serde_json::from_slice(v.value()).map_err(|e| StoreError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("{kind} record '{key}' cannot be decoded: {e}"),
        })?;
        if key_of(&record) != key {
            return Err(StoreError::Corrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "{kind} record stored under '{key}' names '{}'",
                    key_of(&record)
                ),
            });
        }
        out.push(record);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deleting_an_absent_tenant_with_a_record_says_it_was_absent_and_commits_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.put_tenant(&tenant("a", 1)).unwrap();
        let also = |txn: &redb::WriteTransaction| -> Result<(), redb::Error> {
            txn.open_table(TENANTS)?
                .insert("marker", b"{}".as_slice())?;
            Ok(())
        };
        assert!(!store.delete_tenant_with("absent", Some(&also)).unwrap());
        assert!(store.delete_tenant_with("a", Some(&also)).unwrap());
        let db = store.into_db();
        let txn = db.begin_read().unwrap();
        let t = txn.open_table(TENANTS).unwrap();
        assert!(
            t.get("marker").unwrap().is_some(),
            "the extra write committed"
        );
        assert!(t.get("a").unwrap().is_none());
    }

    #[test]
    fn the_writable_watch_hears_of_changes_only_not_of_every_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mut rx = store.writable();
        assert!(*rx.borrow_and_update());
        store.put_tenant(&tenant("a", 1)).unwrap();
        store.put_tenant(&tenant("b", 2)).unwrap();
        assert!(
            !rx.has_changed().unwrap(),
            "commits of a writable store wake no watcher"
        );
        store.fail_commits(true);
        assert!(store.put_tenant(&tenant("c", 3)).is_err());
        assert!(rx.has_changed().unwrap(), "turning unwritable is heard");
        assert!(!*rx.borrow_and_update());
        assert!(store.put_tenant(&tenant("c", 3)).is_err());
        assert!(!rx.has_changed().unwrap(), "a second failure is no change");
        store.fail_commits(false);
        store.put_tenant(&tenant("c", 3)).unwrap();
        assert!(rx.has_changed().unwrap(), "writable again is heard");
        assert!(*rx.borrow_and_update());
        store.put_tenant(&tenant("d", 4)).unwrap();
        assert!(!rx.has_changed().unwrap());
    }

    fn tenant(name: &str, limit: u64) -> TenantRecord {
        TenantRecord {
            name: name.to_string(),
            quota: Quota {
                limit_bytes: limit,
                max_leases: 8,
                priority: -3,
                guaranteed_bytes: limit / 2,
                host_limit_bytes: u64::MAX,
                turn_weight: 3,
                ..Quota::default()
            },
        }
    }

    #[test]
    fn records_written_before_turn_weights_still_load() {
        let old = r#"{"name":"a","limit_bytes":1,"max_leases":0,"priority":0,"guaranteed_bytes":0,"host_limit_bytes":0}"#;
        let t: TenantRecord = serde_json::from_str(old).unwrap();
        assert_eq!(t.quota.turn_weight, 0);
        assert_eq!(t.quota.limit_bytes, 1);
    }

    #[test]
    fn per_device_caps_round_trip_through_the_record() {
        let mut t = tenant("a", 100);
        t.quota.device_limit_bytes = [(0, 5), (3, 0)].into();
        let json = serde_json::to_string(&t).unwrap();
        assert!(
            json.contains(r#""device_limit_bytes":{"0":5,"3":0}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<TenantRecord>(&json).unwrap(), t);
        let bad = json.replace(r#""3":0"#, r#""x":0"#);
        let e = serde_json::from_str::<TenantRecord>(&bad).unwrap_err();
        assert!(e.to_string().contains("not a device index"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.put_tenant(&t).unwrap();
        assert_eq!(store.load().unwrap().0, [t]);
    }

    /// `tests/data/state-schema1.redb` was written by the broker before the quota had one
    /// definition (its own `TenantRecord` fields): tenant `training` (24 GiB, 16 leases,
    /// priority 5, 8 GiB guaranteed, 2 GiB host, turn weight 3), tenant `inference`
    /// (8 GiB, the rest 0) and a worker token `trainer` of `training`.
    #[test]
    fn a_state_file_of_the_earlier_format_loads_and_is_written_back_the_same() {
        const GIB: u64 = 1 << 30;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(STATE_FILE_NAME);
        std::fs::write(&file, include_bytes!("../tests/data/state-schema1.redb")).unwrap();
        let records = |table: TableDefinition<&str, &[u8]>| -> Vec<(String, Vec<u8>)> {
            let db = Database::open(&file).unwrap();
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(table).unwrap();
            table
                .iter()
                .unwrap()
                .map(|r| {
                    let (k, v) = r.unwrap();
                    (k.value().to_string(), v.value().to_vec())
                })
                .collect()
        };
        let (tenants_before, tokens_before) = (records(TENANTS), records(TOKENS));
        assert_eq!((tenants_before.len(), tokens_before.len()), (2, 1));
        let store = Store::open(dir.path()).unwrap();
        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(
            tenants,
            [
                TenantRecord {
                    name: "inference".into(),
                    quota: Quota {
                        limit_bytes: 8 * GIB,
                        ..Quota::default()
                    },
                },
                TenantRecord {
                    name: "training".into(),
                    quota: Quota {
                        limit_bytes: 24 * GIB,
                        max_leases: 16,
                        priority: 5,
                        guaranteed_bytes: 8 * GIB,
                        host_limit_bytes: 2 * GIB,
                        turn_weight: 3,
                        ..Quota::default()
                    },
                },
            ]
        );
        assert_eq!(tokens.len(), 1);
        assert_eq!(
            (tokens[0].tenant.as_str(), tokens[0].name.as_str()),
            ("training", "trainer")
        );
        assert_eq!(tokens[0].scope, crate::auth::Scope::Worker);
        assert_eq!(tokens[0].description, "old worker token");
        // Written back, each record is byte for byte what the earlier broker wrote.
        for t in &tenants {
            store.put_tenant(t).unwrap();
        }
        for t in &tokens {
            store.put_token(t).unwrap();
        }
        drop(store);
        for (table, before) in [(TENANTS, tenants_before), (TOKENS, tokens_before)] {
            let now = records(table);
            assert_eq!(now.len(), before.len());
            for ((name, was), (_, is)) in before.iter().zip(&now) {
                assert_eq!(
                    String::from_utf8_lossy(is),
                    String::from_utf8_lossy(was),
                    "{name}"
                );
            }
        }
    }

    fn token(id: &str, tenant: &str) -> TokenRecord {
        TokenRecord {
            token_id: id.to_string(),
            tenant: tenant.to_string(),
            hash: [id.len() as u8; 32],
            description: format!("token {id} of {tenant}"),
            created_unix_ms: 1_764_460_800_000,
            name: format!("n-{id}"),
            scope: crate::auth::Scope::Worker,
            expires_unix_ms: Some(1_864_460_800_000),
        }
    }

    #[test]
    fn claims_round_trip_and_a_file_without_their_table_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.load_claims().unwrap(), Vec::new(), "no table yet");
        let c = ClaimRecord {
            uid: "uid-1".into(),
            reservation_id: uuid::Uuid::nil().to_string(),
            tenant: "a".into(),
            device: 0,
            device_uuid: "GPU-0".into(),
            bytes: 2 << 20,
            label: "ns/c".into(),
            token_id: "t1".into(),
            created_unix_ms: 7,
        };
        s.put_claim(&c).unwrap();
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.load_claims().unwrap(), vec![c]);
        assert!(s.delete_claim("uid-1").unwrap());
        assert!(!s.delete_claim("uid-1").unwrap());
        assert_eq!(s.load_claims().unwrap(), Vec::new());
    }

    #[test]
    fn tokens_written_before_scopes_still_load() {
        let old = r#"{"token_id":"ab","tenant":"a","hash_hex":"0000000000000000000000000000000000000000000000000000000000000000","description":"d","created_unix_ms":1}"#;
        let t: TokenRecord = serde_json::from_str(old).unwrap();
        assert_eq!((t.name.as_str(), t.scope), ("", crate::auth::Scope::Worker));
        assert_eq!(t.expires_unix_ms, None);
        let blank_scope = old.replace("}", r#","scope":""}"#);
        let t: TokenRecord = serde_json::from_str(&blank_scope).unwrap();
        assert_eq!(t.scope, crate::auth::Scope::Worker);
        for bad in [
            old.replace("}", r#","scope":"root"}"#),
            old.replace(r#""hash_hex":"00"#, r#""hash_hex":"zz"#),
        ] {
            assert!(serde_json::from_str::<TokenRecord>(&bad).is_err(), "{bad}");
        }
    }

    /// A real database with some content, closed; returns its bytes.
    fn populated(dir: &Path) -> Vec<u8> {
        let store = Store::open(dir).unwrap();
        store.put_tenant(&tenant("a", 1 << 30)).unwrap();
        store.put_tenant(&tenant("b", 2 << 30)).unwrap();
        store.put_token(&token("t1", "a")).unwrap();
        store.put_token(&token("t2", "b")).unwrap();
        let path = store.path().to_path_buf();
        drop(store);
        fs::read(path).unwrap()
    }

    /// Corrupt pages anywhere in the file: opening and loading never panics; each try is
    /// Ok (the byte did not matter) or a clean error.
    #[test]
    fn corrupt_pages_are_errors_never_panics() {
        let dir = tempfile::tempdir().unwrap();
        let good = populated(dir.path());
        let path = dir.path().join(STATE_FILE_NAME);
        let mut panics = Vec::new();
        let step = (good.len() / 300).max(1);
        for at in (0..good.len()).step_by(step) {
            for garbage in [0xffu8, 0x00] {
                let mut bad = good.clone();
                if bad[at] == garbage {
                    continue;
                }
                bad[at] = garbage;
                // Also clobber the rest of the page, as a torn write would.
                let end = (at + 64).min(bad.len());
                bad[at..end].fill(garbage);
                fs::write(&path, &bad).unwrap();
                let r = std::panic::catch_unwind(|| Store::open(dir.path()).and_then(|s| s.load()));
                if r.is_err() {
                    panics.push((at, garbage));
                }
            }
        }
        assert!(
            panics.is_empty(),
            "redb panicked for corruption at {panics:?}"
        );
    }

    /// Writes a schema version straight into the file, as a newer build would.
    fn set_schema(path: &Path, version: u64) {
        let db = Database::open(path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            let v = serde_json::to_vec(&version).unwrap();
            meta.insert(SCHEMA_KEY, v.as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }

    #[test]
    fn store_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Store>();
    }

    #[test]
    fn creates_dir_with_mode_0700_and_empty_state() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("nested").join("state");
        let store = Store::open(&dir).unwrap();
        assert_eq!(store.path(), dir.join(STATE_FILE_NAME));
        assert!(store.path().is_file());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700);
            let mode = fs::metadata(store.path()).unwrap().permissions().mode() & 0o777;
            assert_eq!(
                mode & 0o077,
                0,
                "state file must not be group/world accessible"
            );
        }
        let (tenants, tokens) = store.load().unwrap();
        assert!(tenants.is_empty() && tokens.is_empty());
        // Only the state file is left: no temporary files.
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(STATE_FILE_NAME)]);
    }

    #[test]
    fn round_trip_sorted_and_overwrite() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        store.put_tenant(&tenant("zeta", 1)).unwrap();
        store.put_tenant(&tenant("alpha", 2)).unwrap();
        store.put_tenant(&tenant("mid", 3)).unwrap();
        store.put_token(&token("tok-b", "alpha")).unwrap();
        store.put_token(&token("tok-a", "zeta")).unwrap();

        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(
            tenants,
            vec![tenant("alpha", 2), tenant("mid", 3), tenant("zeta", 1)]
        );
        assert_eq!(
            tokens,
            vec![token("tok-a", "zeta"), token("tok-b", "alpha")]
        );

        // put replaces
        let mut changed = tenant("mid", 99);
        changed.quota.priority = 7;
        store.put_tenant(&changed).unwrap();
        let mut tok = token("tok-a", "zeta");
        tok.description = "rotated".into();
        store.put_token(&tok).unwrap();
        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(tenants.len(), 3);
        assert_eq!(tenants[1], changed);
        assert_eq!(tokens[0], tok);

        assert!(store.delete_token("tok-a").unwrap());
        assert!(!store.delete_token("tok-a").unwrap());
        assert!(!store.delete_token("never").unwrap());
        let (_, tokens) = store.load().unwrap();
        assert_eq!(tokens, vec![token("tok-b", "alpha")]);
    }

    #[test]
    fn empty_keys_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        let err = store.put_tenant(&tenant("", 1)).unwrap_err();
        assert!(matches!(err, StoreError::Invalid { .. }), "{err}");
        let err = store.put_token(&token("", "a")).unwrap_err();
        assert!(matches!(err, StoreError::Invalid { .. }), "{err}");
    }

    #[test]
    fn delete_tenant_removes_its_tokens_only() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        store.put_tenant(&tenant("a", 1)).unwrap();
        store.put_tenant(&tenant("b", 1)).unwrap();
        store.put_token(&token("a1", "a")).unwrap();
        store.put_token(&token("a2", "a")).unwrap();
        store.put_token(&token("b1", "b")).unwrap();

        assert!(store.delete_tenant("a").unwrap());
        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(tenants, vec![tenant("b", 1)]);
        assert_eq!(tokens, vec![token("b1", "b")]);

        assert!(!store.delete_tenant("a").unwrap());
        assert!(!store.delete_tenant("nobody").unwrap());
        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(tenants, vec![tenant("b", 1)]);
        assert_eq!(tokens, vec![token("b1", "b")]);
    }

    #[test]
    fn reopen_after_drop_sees_everything() {
        let tmp = tempfile::tempdir().unwrap();
        {
            let store = Store::open(tmp.path()).unwrap();
            store.put_tenant(&tenant("a", 10)).unwrap();
            store.put_tenant(&tenant("b", 20)).unwrap();
            store.put_token(&token("t1", "a")).unwrap();
            store.put_token(&token("t2", "b")).unwrap();
            assert!(store.delete_token("t2").unwrap());
        }
        let store = Store::open(tmp.path()).unwrap();
        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(tenants, vec![tenant("a", 10), tenant("b", 20)]);
        assert_eq!(tokens, vec![token("t1", "a")]);
        // and it is writable again
        store.put_token(&token("t3", "b")).unwrap();
        drop(store);
        let (_, tokens) = Store::open(tmp.path()).unwrap().load().unwrap();
        assert_eq!(tokens, vec![token("t1", "a"), token("t3", "b")]);
    }

    const CHILD_DIR_ENV: &str = "GPU_BROKER_STORE_TEST_CHILD_DIR";

    /// Runs `child_writes_then_aborts` in a child process that dies without unwinding
    /// (no destructors: like `kill -9`), then returns.
    fn crash_child(dir: &Path, mode: &str) {
        let module = module_path!();
        let test = module.split_once("::").map_or(module, |(_, rest)| rest);
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("{test}::child_writes_then_aborts"),
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR_ENV, format!("{mode}:{}", dir.display()))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "child did not crash: {stderr}");
        assert!(
            stderr.contains("child wrote everything"),
            "child failed: {stderr}"
        );
    }

    /// Not a test by itself: the body of the crash tests' child process.
    #[test]
    #[ignore]
    fn child_writes_then_aborts() {
        let Ok(spec) = std::env::var(CHILD_DIR_ENV) else {
            return;
        };
        let (mode, dir) = spec.split_once(':').unwrap();
        let dir = Path::new(dir);
        match mode {
            // Through the store (quick-repair commits).
            "store" => {
                let store = Store::open(dir).unwrap();
                store.put_tenant(&tenant("a", 1)).unwrap();
                store.put_token(&token("t1", "a")).unwrap();
                std::mem::forget(store);
            }
            // A plain redb commit (no saved allocator state): the file needs a full repair.
            "plain" => {
                drop(Store::open(dir).unwrap());
                let db = Database::open(dir.join(STATE_FILE_NAME)).unwrap();
                let txn = db.begin_write().unwrap();
                {
                    let mut t = txn.open_table(TENANTS).unwrap();
                    let v = serde_json::to_vec(&tenant("a", 1)).unwrap();
                    t.insert("a", v.as_slice()).unwrap();
                }
                txn.commit().unwrap();
                std::mem::forget(db);
            }
            other => panic!("unknown mode {other}"),
        }
        eprintln!("child wrote everything");
        std::process::abort();
    }

    #[test]
    fn reopen_after_crash_sees_committed_writes() {
        let tmp = tempfile::tempdir().unwrap();
        crash_child(tmp.path(), "store");
        let store = Store::open(tmp.path()).unwrap();
        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(tenants, vec![tenant("a", 1)]);
        assert_eq!(tokens, vec![token("t1", "a")]);
    }

    #[test]
    fn reopen_after_crash_needing_full_repair() {
        let tmp = tempfile::tempdir().unwrap();
        crash_child(tmp.path(), "plain");
        let store = Store::open(tmp.path()).unwrap();
        let (tenants, tokens) = store.load().unwrap();
        assert_eq!(tenants, vec![tenant("a", 1)]);
        assert!(tokens.is_empty());
        store.put_token(&token("t1", "a")).unwrap();
        drop(store);
        assert_eq!(Store::open(tmp.path()).unwrap().load().unwrap().1.len(), 1);
    }

    #[test]
    fn second_open_while_open_is_locked() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        store.put_tenant(&tenant("a", 1)).unwrap();
        let err = Store::open(tmp.path()).unwrap_err();
        assert!(matches!(err, StoreError::Locked { .. }), "{err}");
        // the first handle still works
        assert_eq!(store.load().unwrap().0, vec![tenant("a", 1)]);
    }

    #[test]
    fn garbage_file_is_corrupt_and_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(STATE_FILE_NAME);
        let garbage: Vec<u8> = (0..10_000u32).map(|i| (i * 7919 % 251) as u8).collect();
        fs::write(&path, &garbage).unwrap();

        let err = Store::open(tmp.path()).unwrap_err();
        match &err {
            StoreError::Corrupt { path: p, .. } => assert_eq!(p, &path),
            other => panic!("expected Corrupt, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("left untouched"), "{msg}");
        assert_eq!(fs::read(&path).unwrap(), garbage);
        // and again: still refused, still untouched
        assert!(matches!(
            Store::open(tmp.path()),
            Err(StoreError::Corrupt { .. })
        ));
        assert_eq!(fs::read(&path).unwrap(), garbage);
    }

    #[test]
    fn empty_file_is_corrupt_and_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(STATE_FILE_NAME);
        fs::write(&path, b"").unwrap();
        let err = Store::open(tmp.path()).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert_eq!(fs::read(&path).unwrap().len(), 0);
    }

    #[test]
    fn truncated_database_errors_and_is_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(STATE_FILE_NAME);
        let full = populated(tmp.path());
        assert!(full.len() > 4096, "database is {} bytes", full.len());

        let mut cuts: Vec<usize> = vec![1, 8, 100, 511, 512, 4096, 4097];
        cuts.extend([
            full.len() / 4,
            full.len() / 2,
            full.len() - 4096,
            full.len() - 1,
        ]);
        for cut in cuts {
            let truncated = full[..cut].to_vec();
            fs::write(&path, &truncated).unwrap();
            let res = Store::open(tmp.path());
            assert!(
                res.is_err(),
                "a database truncated to {cut} of {} bytes was accepted",
                full.len()
            );
            let err = res.unwrap_err();
            assert!(
                matches!(err, StoreError::Corrupt { .. }),
                "cut {cut}: expected Corrupt, got {err:?}"
            );
            assert_eq!(
                fs::read(&path).unwrap(),
                truncated,
                "the file truncated to {cut} bytes was modified"
            );
        }
    }

    #[test]
    fn unknown_newer_schema_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(STATE_FILE_NAME);
        populated(tmp.path());
        set_schema(&path, SCHEMA_VERSION + 1);
        let before = fs::read(&path).unwrap();

        let err = Store::open(tmp.path()).unwrap_err();
        match &err {
            StoreError::UnsupportedSchema {
                found, supported, ..
            } => {
                assert_eq!(*found, SCHEMA_VERSION + 1);
                assert_eq!(*supported, SCHEMA_VERSION);
            }
            other => panic!("expected UnsupportedSchema, got {other:?}"),
        }
        assert!(err.to_string().contains(&path.display().to_string()));
        assert_eq!(
            fs::read(&path).unwrap(),
            before,
            "refused file was modified"
        );

        // the current version opens fine again
        set_schema(&path, SCHEMA_VERSION);
        let (tenants, tokens) = Store::open(tmp.path()).unwrap().load().unwrap();
        assert_eq!(tenants.len(), 2);
        assert_eq!(tokens.len(), 2);
    }

    #[test]
    fn foreign_redb_database_is_refused_and_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(STATE_FILE_NAME);
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let other: TableDefinition<u64, u64> = TableDefinition::new("other");
                txn.open_table(other).unwrap().insert(1, 2).unwrap();
            }
            txn.commit().unwrap();
        }
        let before = fs::read(&path).unwrap();
        let err = Store::open(tmp.path()).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert_eq!(fs::read(&path).unwrap(), before);
    }

    #[test]
    fn bad_record_is_reported_as_corrupt() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(STATE_FILE_NAME);
        populated(tmp.path());
        {
            let db = Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut t = txn.open_table(TENANTS).unwrap();
                t.insert("a", b"{not json".as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }
        let store = Store::open(tmp.path()).unwrap();
        let err = store.load().unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn unreadable_file_is_an_error_and_untouched() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(STATE_FILE_NAME);
        let before = populated(tmp.path());
        fs::set_permissions(&path, fs::Permissions::from_mode(0o000)).unwrap();
        let res = Store::open(tmp.path());
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        // root ignores file permissions: then the open succeeds, and that is fine.
        if let Err(err) = res {
            assert!(matches!(err, StoreError::Unreadable { .. }), "{err}");
            assert!(err.to_string().contains("left untouched"));
            assert_eq!(fs::read(&path).unwrap(), before);
        }
    }
}
