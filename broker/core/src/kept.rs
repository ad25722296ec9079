//! What a restarted broker needs to take back a session or a lease, as its keeper keeps it
//! (the daemon's `keeper/`):
//! versioned JSON records under the keys `session/<id>`, `lease/<id>` (a lease's record
//! travels with its block's descriptor), `drain/<device>` (a device being drained),
//! `quarantine/<lease>`, `publication/<id>` and `import/<id>` (a shared lease's
//! publication and its imports: no descriptor, the publisher's lease has it),
//! `held/<lease>` (an ended lease's block held for its importers, with its publication,
//! or for processes outside its session that fetched its descriptor; its descriptor
//! travels with it), `lingering/<import>` (an import let go while its
//! process may still map the memory), `stranded/<id>` (memory a free left on its device,
//! held by processes outside the broker and charged to a tenant until they exit: no
//! descriptor, the processes hold it), and
//! `reservation/<id>` (a session's process reservation), and `reclaim/<lease>` (a lease's
//! holder asked for it back, by a deadline).
//! A broker that knows a key's kind not (an earlier version) drops that record: a drain
//! ends, a publication and its imports are forgotten, and it serves on. A record carries its format version `v`; a newer
//! broker reads every older version, and fields added later have defaults, so a record
//! written by this version is read by the next (tested with a record of this version,
//! `records_written_by_this_version_are_read_back`). A record names its device by UUID
//! (`device_uuid`, since the index of a GPU can change across a restart) and by index.

use serde::{Deserialize, Serialize};

/// The record format this broker writes.
pub const RECORD_VERSION: u32 = 1;

/// The key prefix of session records.
pub const SESSION_PREFIX: &str = "session/";
/// The key prefix of lease records.
pub const LEASE_PREFIX: &str = "lease/";
/// The key prefix of drain records.
pub const DRAIN_PREFIX: &str = "drain/";
/// The key prefix of quarantine records.
pub const QUARANTINE_PREFIX: &str = "quarantine/";

/// The key prefix of publication records.
pub const PUBLICATION_PREFIX: &str = "publication/";
/// The key prefix of import records.
pub const IMPORT_PREFIX: &str = "import/";

/// A live lease published for importers (or unpublished while imports hold it): taken
/// back with the same id and name when its lease is. Its descriptor for importers is
/// made again from the lease's block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicationRecord {
    pub v: u32,
    pub id: String,
    /// The publisher's live lease.
    pub lease: String,
    pub publisher: String,
    /// None once unpublished (kept while imported).
    pub name: Option<String>,
    #[serde(default)]
    pub readers: Vec<String>,
    #[serde(default)]
    pub published_unix_ms: u64,
}

impl PublicationRecord {
    pub fn key(&self) -> String {
        format!("{PUBLICATION_PREFIX}{}", self.id)
    }
}

/// The key of publication `id`'s record.
pub fn publication_key(id: &uuid::Uuid) -> String {
    format!("{PUBLICATION_PREFIX}{id}")
}

/// An import of a publication by a session, kept once its descriptor reached a process:
/// taken back while that session is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportRecord {
    pub v: u32,
    pub id: String,
    pub publication: String,
    pub tenant: String,
    pub session: String,
    pub pid: Option<u32>,
    #[serde(default)]
    pub created_unix_ms: u64,
    /// Processes outside its session that fetched its descriptor, as
    /// [`LeaseRecord::recipients`]: it lingers for those still alive when it is let go.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recipients: Vec<ProcessRecord>,
}

impl ImportRecord {
    pub fn key(&self) -> String {
        format!("{IMPORT_PREFIX}{}", self.id)
    }
}

/// The key of import `id`'s record.
pub fn import_key(id: &uuid::Uuid) -> String {
    format!("{IMPORT_PREFIX}{id}")
}

/// The key prefix of held block records.
pub const HELD_PREFIX: &str = "held/";
/// The key prefix of lingering import records.
pub const LINGERING_PREFIX: &str = "lingering/";

/// A process that may still map memory, and when it started (a reused pid is not it;
/// None: unknown, then it counts as that process while the pid lives).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub pid: u32,
    #[serde(default)]
    pub start: Option<u64>,
}

/// A process a block's descriptor reached that may keep it past its lease's end
/// (`pool::Reached`): its start time where known (a reused pid is not it) and, for another
/// tenant's importer, that tenant (which answers for memory only it kept).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReachedRecord {
    pub pid: u32,
    #[serde(default)]
    pub start: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// The publication of an ended lease, kept while imports hold its block: importers of
/// it find it by id (its name went with the lease).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPublicationRecord {
    pub id: String,
    #[serde(default)]
    pub readers: Vec<String>,
    #[serde(default)]
    pub published_unix_ms: u64,
}

/// The block of an ended lease held while its importers (and the processes in
/// `waiters`) may map it: counted to its tenant as quarantined bytes until they all let
/// go, then freed. Its descriptor travels with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRecord {
    pub v: u32,
    /// The ended lease's id.
    pub lease: String,
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    pub block_id: u64,
    /// `cuda-vmm` or `host-memfd`.
    pub kind: String,
    /// The publication whose imports hold it.
    #[serde(default)]
    pub publication: Option<HeldPublicationRecord>,
    /// Other processes that may map it (the lease's own, ones that fetched its
    /// descriptor).
    #[serde(default)]
    pub waiters: Vec<ProcessRecord>,
    /// Those of `waiters` outside the lease's session that fetched its descriptor, with
    /// their start times (in `waiters` without one, as earlier versions read them): a
    /// recipient whose pid another process took since is not waited for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recipients: Vec<ProcessRecord>,
    /// The processes its block's descriptor reached that may keep it past their lease's
    /// end (`pool::Reached`): a free after a restart checks for them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reached: Vec<ReachedRecord>,
    /// Held for a holder of unknown pid until the quarantine timeout.
    #[serde(default)]
    pub timeout: bool,
    /// Freed, never cached, when let go.
    #[serde(default)]
    pub destroy: bool,
    /// As in [`LeaseRecord::device_uuid`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
}

impl HeldRecord {
    pub fn key(&self) -> String {
        format!("{HELD_PREFIX}{}", self.lease)
    }
}

/// The key of ended lease `id`'s held block record.
pub fn held_key(id: &uuid::Uuid) -> String {
    format!("{HELD_PREFIX}{id}")
}

/// An import whose holder let go (its session ended) while processes that may map the
/// memory live: it ends when they are gone. Its publication's memory is kept by the
/// publisher's lease or held block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LingeringRecord {
    pub v: u32,
    pub id: String,
    pub publication: String,
    pub tenant: String,
    pub session: String,
    pub pid: Option<u32>,
    #[serde(default)]
    pub created_unix_ms: u64,
    pub waiters: Vec<ProcessRecord>,
    #[serde(default)]
    pub timeout: bool,
}

impl LingeringRecord {
    pub fn key(&self) -> String {
        format!("{LINGERING_PREFIX}{}", self.id)
    }
}

/// The key of import `id`'s lingering record.
pub fn lingering_key(id: &uuid::Uuid) -> String {
    format!("{LINGERING_PREFIX}{id}")
}

/// The key prefix of stranded memory records.
pub const STRANDED_PREFIX: &str = "stranded/";

/// Memory a free left on its device because processes outside the broker keep it,
/// charged to `tenant` as quarantined until they exit. No descriptor travels with it: the
/// memory is theirs, and a copy here would keep it alive after they let go.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StrandedRecord {
    pub v: u32,
    pub id: String,
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    /// `cuda-vmm` or `host-memfd`, when the shell said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The processes that may keep it, with their start times where known (a reused pid
    /// is not one of them).
    pub holders: Vec<ProcessRecord>,
    /// Let go when its holders are gone (false: only when the kernel says nobody holds
    /// the file; a restarted broker then watches the named holders that live).
    #[serde(default)]
    pub watched: bool,
    /// Processes near its holders are looked for when the last one exits (CUDA).
    #[serde(default)]
    pub recheck: bool,
    #[serde(default)]
    pub stranded_unix_ms: u64,
    /// As in [`LeaseRecord::device_uuid`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
    /// A memfd's file handle, by which a restarted broker asks the kernel whether anyone
    /// (named or not) still holds the file; it holds nothing open. Absent: its holders'
    /// exits lift it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_handle: Option<FileHandleRecord>,
}

/// A file handle as `name_to_handle_at` gives it: its type and opaque bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileHandleRecord {
    pub handle_type: i32,
    pub bytes: Vec<u8>,
}

impl StrandedRecord {
    pub fn key(&self) -> String {
        format!("{STRANDED_PREFIX}{}", self.id)
    }
}

/// The key of stranded memory `id`'s record.
pub fn stranded_key(id: &uuid::Uuid) -> String {
    format!("{STRANDED_PREFIX}{id}")
}

/// The key prefix of reclaim request records.
pub const RECLAIM_PREFIX: &str = "reclaim/";

/// A reclaim request of a lease: its holder must give it back by the deadline (wall
/// clock), or it is revoked; a restarted broker asks by the same deadline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimRecord {
    pub v: u32,
    pub lease: String,
    pub deadline_unix_ms: u64,
}

impl ReclaimRecord {
    pub fn key(&self) -> String {
        format!("{RECLAIM_PREFIX}{}", self.lease)
    }
}

/// The key of lease `id`'s reclaim record.
pub fn reclaim_key(id: &uuid::Uuid) -> String {
    format!("{RECLAIM_PREFIX}{id}")
}

/// The key prefix of process reservation records.
pub const RESERVATION_PREFIX: &str = "reservation/";

/// A session's process reservation (not a claim's: the store keeps those): taken back
/// with its session, the same id and room, its drawn leases drawn from it again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationRecord {
    pub v: u32,
    pub id: String,
    pub tenant: String,
    pub session: String,
    pub device: u32,
    /// Rounded size (what the tenant is charged, drawn leases included).
    pub bytes: u64,
    #[serde(default)]
    pub requested_bytes: u64,
    #[serde(default)]
    pub label: String,
    pub pid: Option<u32>,
    #[serde(default)]
    pub compute_percent: Option<u32>,
    #[serde(default)]
    pub created_unix_ms: u64,
    /// Bytes of drawn leases that ended quarantined: no longer its room.
    #[serde(default)]
    pub lost: u64,
    /// Its program's process group, stopped when it ends.
    #[serde(default)]
    pub group: Option<GroupRecord>,
    /// The device's UUID, as in [`LeaseRecord::device_uuid`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
}

/// A reservation's process group (`crate::process_group::ProcessGroup`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    pub pgid: u32,
    pub uid: u32,
    pub leader_start: u64,
}

impl ReservationRecord {
    pub fn key(&self) -> String {
        format!("{RESERVATION_PREFIX}{}", self.id)
    }
}

/// The key of reservation `id`'s record.
pub fn reservation_key(id: &uuid::Uuid) -> String {
    format!("{RESERVATION_PREFIX}{id}")
}

impl From<&crate::reservations::Reservation> for ReservationRecord {
    fn from(r: &crate::reservations::Reservation) -> Self {
        ReservationRecord {
            v: RECORD_VERSION,
            id: r.id.to_string(),
            tenant: r.tenant.clone(),
            session: r.session.to_string(),
            device: r.device,
            bytes: r.bytes,
            requested_bytes: r.requested_bytes,
            label: r.label.clone(),
            pid: r.pid,
            compute_percent: r.compute_percent,
            created_unix_ms: unix_ms(r.created),
            lost: r.lost,
            group: r.group.map(|g| GroupRecord {
                pgid: g.pgid,
                uid: g.uid,
                leader_start: g.leader_start,
            }),
            // The shell knows the devices' UUIDs: it fills this in.
            device_uuid: None,
        }
    }
}

/// The memory of an ended lease that a live process may still map (quarantined): it stays
/// counted to its tenant until that process exits. Its block's descriptor travels with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantineRecord {
    pub v: u32,
    /// The ended lease's id.
    pub lease: String,
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    pub block_id: u64,
    /// `cuda-vmm` or `host-memfd`.
    pub kind: String,
    /// The process that may map it, and its start time (a reused pid is not it).
    pub pid: Option<u32>,
    #[serde(default)]
    pub pid_start: Option<u64>,
    /// Freed, never cached, when lifted.
    #[serde(default)]
    pub destroy: bool,
    /// The device's UUID (`GPU-...`, `HOST-...`): a restarted broker finds the device by
    /// it, whatever its index is now, and lets the memory go when no device has it.
    /// Records without one (written before it) go by `device`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
    /// The processes its block's descriptor reached that may keep it past their lease's
    /// end (`pool::Reached`): a free after a restart checks for them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reached: Vec<ReachedRecord>,
    /// The session whose process retained the block mapped on purpose (`retain_mapping`):
    /// after a restart that process letting go of it by word frees it, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retained_by: Option<String>,
}

impl QuarantineRecord {
    pub fn key(&self) -> String {
        format!("{QUARANTINE_PREFIX}{}", self.lease)
    }
}

/// The key of ended lease `id`'s quarantine record.
pub fn quarantine_key(id: &uuid::Uuid) -> String {
    format!("{QUARANTINE_PREFIX}{id}")
}

/// An open session: whose it is, which process holds it (and when that process started,
/// so a reused pid is not taken for it), and the hash of its resume secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub v: u32,
    pub id: String,
    pub tenant: String,
    pub name: String,
    pub pid: Option<u32>,
    pub uid: Option<u32>,
    #[serde(default)]
    pub unix: bool,
    /// The peer process's start time (clock ticks since boot, `/proc/<pid>/stat`).
    pub pid_start: Option<u64>,
    #[serde(default)]
    pub token_id: Option<String>,
    /// SHA-256 of the resume secret the worker was given, hex.
    pub resume_hash: Option<String>,
    #[serde(default)]
    pub opened_unix_ms: u64,
}

/// A live lease of a session, on the block whose descriptor travels with this record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub v: u32,
    pub id: String,
    pub tenant: String,
    pub session: String,
    pub device: u32,
    /// `device` or `host`.
    pub tier: String,
    /// The block's bytes (what the quota is charged).
    pub bytes: u64,
    #[serde(default)]
    pub requested_bytes: u64,
    #[serde(default)]
    pub label: String,
    #[serde(default)]
    pub reclaimable: bool,
    #[serde(default)]
    pub created_unix_ms: u64,
    #[serde(default)]
    pub priority: i32,
    /// The memory object's id, as workers know it.
    pub block_id: u64,
    /// `cuda-vmm` or `host-memfd`.
    pub kind: String,
    /// The process reservation its bytes were drawn from.
    #[serde(default)]
    pub reservation: Option<String>,
    /// The device's UUID (`GPU-...`, `HOST-...`): a restarted broker finds the device by
    /// it, whatever its index is now, and lets the memory go when no device has it.
    /// Records without one (written before it) go by `device`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
    /// Processes outside its session that fetched its descriptor (a renewed ticket), with
    /// their start times, at most [`crate::pool::Reached::MAX`]: when the lease ends its
    /// memory is held for those still alive, a restart or not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recipients: Vec<ProcessRecord>,
    /// The processes its block's descriptor reached that may keep it past their lease's
    /// end (`pool::Reached`): a free after a restart checks for them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reached: Vec<ReachedRecord>,
}

/// A device an operator is draining: it stays closed to new leases across a restart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRecord {
    pub v: u32,
    pub device: u32,
    #[serde(default)]
    pub since_unix_ms: u64,
    /// When its holders must have given reclaimable memory back (wall clock).
    #[serde(default)]
    pub deadline_unix_ms: Option<u64>,
    #[serde(default)]
    pub reason: String,
    /// The device's UUID (`GPU-...`, `HOST-...`): a restarted broker finds the device by
    /// it, whatever its index is now, and lets the memory go when no device has it.
    /// Records without one (written before it) go by `device`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
}

impl DrainRecord {
    pub fn key(&self) -> String {
        drain_key(self.device)
    }
}

/// The key of device `device`'s drain record.
pub fn drain_key(device: u32) -> String {
    format!("{DRAIN_PREFIX}{device}")
}

/// A record read back from the keeper.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kept {
    Session(SessionRecord),
    Lease(LeaseRecord),
    Drain(DrainRecord),
    Quarantine(QuarantineRecord),
    Publication(PublicationRecord),
    Import(ImportRecord),
    Reservation(ReservationRecord),
    Reclaim(ReclaimRecord),
    Held(HeldRecord),
    Lingering(LingeringRecord),
    Stranded(StrandedRecord),
}

impl Kept {
    /// The key this record is kept under, as its own fields give it.
    pub fn key(&self) -> String {
        match self {
            Kept::Session(r) => r.key(),
            Kept::Lease(r) => r.key(),
            Kept::Drain(r) => r.key(),
            Kept::Quarantine(r) => r.key(),
            Kept::Publication(r) => r.key(),
            Kept::Import(r) => r.key(),
            Kept::Reservation(r) => r.key(),
            Kept::Reclaim(r) => r.key(),
            Kept::Held(r) => r.key(),
            Kept::Lingering(r) => r.key(),
            Kept::Stranded(r) => r.key(),
        }
    }
}

/// Why a kept record cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("kept record {key:?} is not readable: {why}")]
    Unreadable { key: String, why: String },
    #[error("kept record {key:?} has an unknown key")]
    UnknownKey { key: String },
}

impl SessionRecord {
    pub fn key(&self) -> String {
        format!("{SESSION_PREFIX}{}", self.id)
    }
}

impl LeaseRecord {
    pub fn key(&self) -> String {
        format!("{LEASE_PREFIX}{}", self.id)
    }
}

/// A record's wall-clock time back from its milliseconds since the epoch.
pub fn from_unix_ms(ms: u64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)
}

pub fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl From<&crate::session::Session> for SessionRecord {
    fn from(s: &crate::session::Session) -> Self {
        SessionRecord {
            v: RECORD_VERSION,
            id: s.id.to_string(),
            tenant: s.tenant.clone(),
            name: s.name.clone(),
            pid: s.peer.pid,
            uid: s.peer.uid,
            unix: s.peer.unix,
            pid_start: s.peer_start,
            token_id: s.token_id.clone(),
            resume_hash: s.resume_hash.clone(),
            opened_unix_ms: unix_ms(s.opened),
        }
    }
}

impl From<&crate::lease::Lease> for LeaseRecord {
    fn from(l: &crate::lease::Lease) -> Self {
        let (block_id, kind) = match &l.block.handle {
            crate::memory::Handle::Fd { block_id, kind, .. } => (*block_id, *kind),
        };
        LeaseRecord {
            v: RECORD_VERSION,
            id: l.id.to_string(),
            tenant: l.tenant.clone(),
            session: l.session.to_string(),
            device: l.device,
            tier: match l.tier {
                crate::ledger::Tier::Device => "device",
                crate::ledger::Tier::Host => "host",
            }
            .into(),
            bytes: l.bytes(),
            requested_bytes: l.requested_bytes,
            label: l.label.clone(),
            reclaimable: l.reclaimable,
            created_unix_ms: unix_ms(l.created),
            priority: l.priority,
            block_id,
            kind: match kind {
                crate::memory::MemoryKind::CudaVmm => "cuda-vmm",
                crate::memory::MemoryKind::HostMemfd => "host-memfd",
            }
            .into(),
            reservation: l.reservation.map(|r| r.to_string()),
            // The shell knows the devices' UUIDs: it fills this in.
            device_uuid: None,
            // The state knows them (`State::lease_kept`).
            recipients: Vec::new(),
            reached: l.block.reached.records(),
        }
    }
}

/// The key of session `id`'s record.
pub fn session_key(id: &uuid::Uuid) -> String {
    format!("{SESSION_PREFIX}{id}")
}

/// The key of lease `id`'s record.
pub fn lease_key(id: &uuid::Uuid) -> String {
    format!("{LEASE_PREFIX}{id}")
}

/// Reads the record kept under `key`. A record whose own fields name another key is
/// damaged and refused: every later removal goes by the key its fields give, which would
/// leave the one it was read under in the keeper for good.
pub fn parse(key: &str, record: serde_json::Value) -> Result<Kept, RecordError> {
    let kept = parse_any(key, record)?;
    let own = kept.key();
    if own != key {
        return Err(RecordError::Unreadable {
            key: key.to_string(),
            why: format!("its fields name the key {own:?}"),
        });
    }
    Ok(kept)
}

/// [`parse`], whatever key the record's fields name.
fn parse_any(key: &str, record: serde_json::Value) -> Result<Kept, RecordError> {
    let unreadable = |why: String| RecordError::Unreadable {
        key: key.to_string(),
        why,
    };
    let v = record.get("v").and_then(|v| v.as_u64()).unwrap_or(0);
    if v == 0 {
        return Err(unreadable("no format version".into()));
    }
    if key.starts_with(SESSION_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Session)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(LEASE_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Lease)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(DRAIN_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Drain)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(QUARANTINE_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Quarantine)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(PUBLICATION_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Publication)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(IMPORT_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Import)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(RESERVATION_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Reservation)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(RECLAIM_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Reclaim)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(HELD_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Held)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(LINGERING_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Lingering)
            .map_err(|e| unreadable(e.to_string()))
    } else if key.starts_with(STRANDED_PREFIX) {
        serde_json::from_value(record)
            .map(Kept::Stranded)
            .map_err(|e| unreadable(e.to_string()))
    } else {
        Err(RecordError::UnknownKey {
            key: key.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records as this version writes them, byte for byte: the next version must read
    /// them (a new field needs a default; a renamed one breaks this test).
    #[test]
    fn records_written_by_this_version_are_read_back() {
        let session = r#"{"v":1,"id":"0193a0b2-0000-7000-8000-000000000001","tenant":"alpha","name":"w","pid":4242,"uid":1000,"unix":true,"pid_start":123456,"token_id":"t1","resume_hash":"ab","opened_unix_ms":1764800000000}"#;
        let lease = r#"{"v":1,"id":"0193a0b2-0000-4000-8000-000000000002","tenant":"alpha","session":"0193a0b2-0000-7000-8000-000000000001","device":0,"tier":"device","bytes":8388608,"requested_bytes":8000000,"label":"kv","reclaimable":true,"created_unix_ms":1764800000001,"priority":3,"block_id":77,"kind":"host-memfd","reservation":null}"#;
        let s = parse(
            "session/0193a0b2-0000-7000-8000-000000000001",
            serde_json::from_str(session).unwrap(),
        )
        .unwrap();
        let Kept::Session(s) = s else { panic!("{s:?}") };
        assert_eq!(
            (s.pid, s.uid, s.pid_start, s.resume_hash.as_deref()),
            (Some(4242), Some(1000), Some(123456), Some("ab"))
        );
        assert_eq!(serde_json::to_string(&s).unwrap(), session);
        let l = parse(
            "lease/0193a0b2-0000-4000-8000-000000000002",
            serde_json::from_str(lease).unwrap(),
        )
        .unwrap();
        let Kept::Lease(l) = l else { panic!("{l:?}") };
        assert_eq!((l.bytes, l.block_id, l.priority), (8 << 20, 77, 3));
        assert_eq!(l.device_uuid, None, "a record before UUIDs goes by index");
        assert_eq!(serde_json::to_string(&l).unwrap(), lease);
        // This version's: the device's UUID too.
        let with_uuid = lease.replace(
            r#""reservation":null}"#,
            r#""reservation":null,"device_uuid":"GPU-4f1d0c2a-0000-0000-0000-000000000001"}"#,
        );
        let Kept::Lease(l) = parse(&l.key(), serde_json::from_str(&with_uuid).unwrap()).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            l.device_uuid.as_deref(),
            Some("GPU-4f1d0c2a-0000-0000-0000-000000000001")
        );
        assert_eq!(serde_json::to_string(&l).unwrap(), with_uuid);
        assert!(
            l.recipients.is_empty(),
            "an older record names no recipients"
        );
        // And the processes outside its session that fetched its descriptor.
        let with_recipients = with_uuid.replace(
            r#"0001"}"#,
            r#"0001","recipients":[{"pid":4343,"start":123999},{"pid":0,"start":null}]}"#,
        );
        let Kept::Lease(l) =
            parse(&l.key(), serde_json::from_str(&with_recipients).unwrap()).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            l.recipients,
            [
                ProcessRecord {
                    pid: 4343,
                    start: Some(123999)
                },
                ProcessRecord {
                    pid: 0,
                    start: None
                }
            ]
        );
        assert_eq!(serde_json::to_string(&l).unwrap(), with_recipients);
        let drain = r#"{"v":1,"device":1,"since_unix_ms":1764800000002,"deadline_unix_ms":1764800600002,"reason":"upgrade"}"#;
        let d = parse("drain/1", serde_json::from_str(drain).unwrap()).unwrap();
        let Kept::Drain(d) = d else { panic!("{d:?}") };
        assert_eq!((d.device, d.reason.as_str()), (1, "upgrade"));
        assert_eq!(d.key(), "drain/1");
        assert_eq!(serde_json::to_string(&d).unwrap(), drain);
        let q = r#"{"v":1,"lease":"0193a0b2-0000-4000-8000-000000000003","tenant":"alpha","device":0,"bytes":8388608,"block_id":78,"kind":"host-memfd","pid":4242,"pid_start":123456,"destroy":false}"#;
        let k = parse(
            "quarantine/0193a0b2-0000-4000-8000-000000000003",
            serde_json::from_str(q).unwrap(),
        )
        .unwrap();
        let Kept::Quarantine(k) = k else {
            panic!("{k:?}")
        };
        assert_eq!(
            (k.pid, k.pid_start, k.block_id),
            (Some(4242), Some(123456), 78)
        );
        assert_eq!(serde_json::to_string(&k).unwrap(), q);
        assert!(
            k.reached.is_empty(),
            "an older record names nobody it reached"
        );
        // With the processes its block reached: one of another tenant (an importer).
        let with_reached = q.replace(
            r#""destroy":false}"#,
            r#""destroy":false,"reached":[{"pid":4000,"start":120000},{"pid":4343,"start":null,"tenant":"beta"}]}"#,
        );
        let Kept::Quarantine(k) =
            parse(&k.key(), serde_json::from_str(&with_reached).unwrap()).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            k.reached,
            [
                ReachedRecord {
                    pid: 4000,
                    start: Some(120000),
                    tenant: None
                },
                ReachedRecord {
                    pid: 4343,
                    start: None,
                    tenant: Some("beta".into())
                }
            ]
        );
        assert_eq!(serde_json::to_string(&k).unwrap(), with_reached);
        let p = r#"{"v":1,"id":"0193a0b2-0000-4000-8000-000000000004","lease":"0193a0b2-0000-4000-8000-000000000002","publisher":"alpha","name":"weights","readers":["beta"],"published_unix_ms":1764800000003}"#;
        let Kept::Publication(r) = parse(
            "publication/0193a0b2-0000-4000-8000-000000000004",
            serde_json::from_str(p).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            (r.name.as_deref(), r.readers.as_slice()),
            (Some("weights"), &["beta".to_string()][..])
        );
        assert_eq!(serde_json::to_string(&r).unwrap(), p);
        let i = r#"{"v":1,"id":"0193a0b2-0000-4000-8000-000000000005","publication":"0193a0b2-0000-4000-8000-000000000004","tenant":"beta","session":"0193a0b2-0000-7000-8000-000000000006","pid":4343,"created_unix_ms":1764800000004}"#;
        let Kept::Import(r) = parse(
            "import/0193a0b2-0000-4000-8000-000000000005",
            serde_json::from_str(i).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!((r.tenant.as_str(), r.pid), ("beta", Some(4343)));
        assert_eq!(r.key(), "import/0193a0b2-0000-4000-8000-000000000005");
        assert_eq!(serde_json::to_string(&r).unwrap(), i);
        assert!(r.recipients.is_empty());
        let with_recipients = i.replace(
            r#"004}"#,
            r#"004,"recipients":[{"pid":4444,"start":124000}]}"#,
        );
        let Kept::Import(r) =
            parse(&r.key(), serde_json::from_str(&with_recipients).unwrap()).unwrap()
        else {
            panic!()
        };
        assert_eq!(r.recipients[0].start, Some(124000));
        assert_eq!(serde_json::to_string(&r).unwrap(), with_recipients);
        let res = r#"{"v":1,"id":"0193a0b2-0000-7000-8000-000000000007","tenant":"alpha","session":"0193a0b2-0000-7000-8000-000000000001","device":0,"bytes":16777216,"requested_bytes":16000000,"label":"run","pid":4242,"compute_percent":50,"created_unix_ms":1764800000005,"lost":2097152,"group":{"pgid":4250,"uid":1000,"leader_start":123460},"device_uuid":"GPU-4f1d0c2a-0000-0000-0000-000000000001"}"#;
        let Kept::Reservation(r) = parse(
            "reservation/0193a0b2-0000-7000-8000-000000000007",
            serde_json::from_str(res).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            (r.bytes, r.lost, r.group.map(|g| g.pgid)),
            (16 << 20, 2 << 20, Some(4250))
        );
        assert_eq!(serde_json::to_string(&r).unwrap(), res);
        let rc = r#"{"v":1,"lease":"0193a0b2-0000-4000-8000-000000000002","deadline_unix_ms":1764800030000}"#;
        let Kept::Reclaim(r) = parse(
            "reclaim/0193a0b2-0000-4000-8000-000000000002",
            serde_json::from_str(rc).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(r.deadline_unix_ms, 1_764_800_030_000);
        assert_eq!(serde_json::to_string(&r).unwrap(), rc);
        let held = r#"{"v":1,"lease":"0193a0b2-0000-4000-8000-000000000008","tenant":"alpha","device":0,"bytes":8388608,"block_id":79,"kind":"cuda-vmm","publication":{"id":"0193a0b2-0000-4000-8000-000000000004","readers":["beta"],"published_unix_ms":1764800000003},"waiters":[{"pid":4242,"start":123456}],"timeout":false,"destroy":true,"device_uuid":"GPU-4f1d0c2a-0000-0000-0000-000000000001"}"#;
        let Kept::Held(r) = parse(
            "held/0193a0b2-0000-4000-8000-000000000008",
            serde_json::from_str(held).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            (
                r.publication.as_ref().map(|p| p.readers.as_slice()),
                r.waiters.as_slice(),
                r.destroy
            ),
            (
                Some(&["beta".to_string()][..]),
                &[ProcessRecord {
                    pid: 4242,
                    start: Some(123456)
                }][..],
                true
            )
        );
        assert_eq!(r.key(), "held/0193a0b2-0000-4000-8000-000000000008");
        assert_eq!(serde_json::to_string(&r).unwrap(), held);
        assert!(r.recipients.is_empty());
        // Held for a recipient of its descriptor too, its start time beside it.
        let held_for_recipient = held.replace(
            r#""timeout":false"#,
            r#""recipients":[{"pid":4343,"start":123999}],"timeout":false"#,
        );
        let held_for_recipient = held_for_recipient.replace(
            r#""waiters":[{"pid":4242,"start":123456}]"#,
            r#""waiters":[{"pid":4242,"start":123456},{"pid":4343,"start":null}]"#,
        );
        let Kept::Held(r) =
            parse(&r.key(), serde_json::from_str(&held_for_recipient).unwrap()).unwrap()
        else {
            panic!()
        };
        assert_eq!((r.waiters.len(), r.recipients[0].start), (2, Some(123999)));
        assert_eq!(serde_json::to_string(&r).unwrap(), held_for_recipient);
        let lingering = r#"{"v":1,"id":"0193a0b2-0000-4000-8000-000000000009","publication":"0193a0b2-0000-4000-8000-000000000004","tenant":"beta","session":"0193a0b2-0000-7000-8000-000000000006","pid":4343,"created_unix_ms":1764800000004,"waiters":[{"pid":4343,"start":123999}],"timeout":false}"#;
        let Kept::Lingering(r) = parse(
            "lingering/0193a0b2-0000-4000-8000-000000000009",
            serde_json::from_str(lingering).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            (r.tenant.as_str(), r.waiters[0].start),
            ("beta", Some(123999))
        );
        assert_eq!(r.key(), "lingering/0193a0b2-0000-4000-8000-000000000009");
        assert_eq!(serde_json::to_string(&r).unwrap(), lingering);
        let stranded = r#"{"v":1,"id":"0193a0b2-0000-4000-8000-00000000000a","tenant":"alpha","device":0,"bytes":8388608,"kind":"cuda-vmm","holders":[{"pid":4444,"start":124000},{"pid":4445,"start":null}],"watched":true,"recheck":true,"stranded_unix_ms":1764800000005,"device_uuid":"GPU-4f1d0c2a-0000-0000-0000-000000000001"}"#;
        let Kept::Stranded(r) = parse(
            "stranded/0193a0b2-0000-4000-8000-00000000000a",
            serde_json::from_str(stranded).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            (r.tenant.as_str(), r.bytes, r.holders[0].start, r.recheck),
            ("alpha", 8 * 1024 * 1024, Some(124000), true)
        );
        assert_eq!(r.key(), "stranded/0193a0b2-0000-4000-8000-00000000000a");
        assert_eq!(serde_json::to_string(&r).unwrap(), stranded);
        assert_eq!(r.file_handle, None, "an older record has no file handle");
        let memfd = r#"{"v":1,"id":"0193a0b2-0000-4000-8000-00000000000b","tenant":"alpha","device":0,"bytes":8388608,"kind":"host-memfd","holders":[{"pid":4446,"start":124001}],"watched":false,"recheck":false,"stranded_unix_ms":1764800000006,"device_uuid":"HOST-0","file_handle":{"handle_type":1,"bytes":[1,2,3,4,5,6,7,8,9,10,11,12]}}"#;
        let Kept::Stranded(r) = parse(
            "stranded/0193a0b2-0000-4000-8000-00000000000b",
            serde_json::from_str(memfd).unwrap(),
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            r.file_handle,
            Some(FileHandleRecord {
                handle_type: 1,
                bytes: (1..=12).collect()
            })
        );
        assert_eq!(serde_json::to_string(&r).unwrap(), memfd);
    }

    /// A later version may add fields: this one reads what it knows and keeps going.
    #[test]
    fn fields_of_a_later_version_are_ignored_and_bad_records_are_refused() {
        let newer = serde_json::json!({"v": 2, "id": "x", "tenant": "a", "name": "n", "pid": 1,
            "uid": 0, "pid_start": 5, "resume_hash": null, "numa": 3});
        assert!(matches!(parse("session/x", newer), Ok(Kept::Session(_))));
        let unversioned = serde_json::json!({"id": "x"});
        assert!(matches!(
            parse("session/x", unversioned),
            Err(RecordError::Unreadable { .. })
        ));
        assert!(matches!(
            parse("other/x", serde_json::json!({"v": 1})),
            Err(RecordError::UnknownKey { .. })
        ));
        assert!(matches!(
            parse("lease/x", serde_json::json!({"v": 1, "id": "x"})),
            Err(RecordError::Unreadable { .. })
        ));
    }

    /// A lingering import kept by a version that named its waiters by pid alone reads
    /// with no start times (any process of the pid is waited for), and one with start
    /// times keeps them.
    #[test]
    fn a_lingering_imports_waiters_read_with_or_without_start_times() {
        let record = |waiters| {
            serde_json::json!({"v": 1, "id": "i", "publication": "p", "tenant": "t",
                "session": "s", "pid": 7, "waiters": waiters})
        };
        let waiters = |r| match r {
            Ok(Kept::Lingering(l)) => l
                .waiters
                .iter()
                .map(|w| (w.pid, w.start))
                .collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        let old = parse("lingering/i", record(serde_json::json!([{"pid": 9}])));
        assert_eq!(waiters(old), [(9, None)]);
        let new = parse(
            "lingering/i",
            record(serde_json::json!([{"pid": 9, "start": 123}])),
        );
        assert_eq!(waiters(new), [(9, Some(123))]);
    }

    /// A record kept under a key its fields do not give is damaged: refused, naming the
    /// key it was read under (the one to remove).
    #[test]
    fn a_record_under_another_records_key_is_refused() {
        let session = serde_json::json!({"v": 1, "id": "a", "tenant": "t", "name": "n",
            "pid": null, "uid": null, "pid_start": null, "resume_hash": null});
        assert!(matches!(
            parse("session/a", session.clone()),
            Ok(Kept::Session(_))
        ));
        let err = parse("session/b", session).unwrap_err();
        assert!(
            matches!(&err, RecordError::Unreadable { key, .. } if key == "session/b"),
            "{err}"
        );
        assert!(err.to_string().contains("session/a"), "{err}");
        let drain = serde_json::json!({"v": 1, "device": 2});
        assert!(matches!(
            parse("drain/2", drain.clone()),
            Ok(Kept::Drain(_))
        ));
        assert!(parse("drain/3", drain).is_err());
    }
}
