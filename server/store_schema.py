"""The server store's SQLite schema and format (a store of another format is refused
before anything is written), and the rows an accepted update writes."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from wakefl.errors import ConfigError
from wakefl.protocol.messages import Uplink

# Format 2 (protocol v3): the strategy's uplink record is stored as JSON (`updates.record`,
# `clients.record`) instead of Self-FL's columns (sigma_m_sq, local_steps). A format 1
# store (written before protocol v3) is refused, not migrated: its recorded update files
# are v2 frames the server no longer reads (docs/PROTOCOL.md).
STORE_FORMAT = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER PRIMARY KEY, status TEXT NOT NULL, sampled TEXT NOT NULL,
    deadline REAL NOT NULL, opened_at REAL NOT NULL, closed_at REAL,
    accepted INTEGER NOT NULL DEFAULT 0, state_file TEXT);
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY, device_type TEXT NOT NULL, source TEXT NOT NULL,
    online INTEGER NOT NULL DEFAULT 0, last_seen REAL);
CREATE TABLE IF NOT EXISTS clients (
    device_id TEXT PRIMARY KEY, num_samples INTEGER, record TEXT,
    rounds_reported INTEGER NOT NULL DEFAULT 0, last_round INTEGER,
    relative_fa REAL, relative_fr REAL, rejected INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS updates (
    round_id INTEGER NOT NULL, device_id TEXT NOT NULL, device_type TEXT NOT NULL,
    path TEXT NOT NULL, nbytes INTEGER NOT NULL, num_samples INTEGER NOT NULL,
    record TEXT NOT NULL, received_at REAL NOT NULL,
    PRIMARY KEY (round_id, device_id));
CREATE TABLE IF NOT EXISTS rejections (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rejection_log (
    at REAL NOT NULL, reason TEXT NOT NULL, device_id TEXT, round_id INTEGER, detail TEXT);
CREATE TABLE IF NOT EXISTS declines (
    round_id INTEGER NOT NULL, device_id TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (round_id, device_id));
"""


def open_database(root: Path) -> sqlite3.Connection:
    """The store's connection (WAL, synchronous=FULL: a commit is on disk when it returns),
    its format checked, its tables created when new."""
    try:
        db = sqlite3.connect(
            root / "server.sqlite", check_same_thread=False, isolation_level=None, timeout=30
        )
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        # Checked and created in one transaction: a process opening the folder meanwhile
        # (an aggregation worker waiting for its coordinator) never sees the tables
        # without their format.
        db.execute("BEGIN IMMEDIATE")
        try:
            _check_format(db, root)
            for statement in filter(str.strip, SCHEMA.split(";")):
                db.execute(statement)
            db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('store_format', ?)",
                (json.dumps(STORE_FORMAT),),
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.rollback()
            db.close()
            raise
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"server state {root} is not usable: {exc}") from exc
    return db


def _check_format(db: sqlite3.Connection, root: Path) -> None:
    """Refuse a store of another format (ConfigError) before anything is written."""
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "meta" not in tables:
        return  # a new store
    row = db.execute("SELECT value FROM meta WHERE key='store_format'").fetchone()
    found = json.loads(row[0]) if row is not None else 1
    if found != STORE_FORMAT:
        raise ConfigError(
            f"server state {root} is in store format {found} (written before wire "
            f"protocol v3); this server reads format {STORE_FORMAT}. Finish "
            "that run with the release that started it, or start this one in a new --state "
            "folder"
        )


def mark_online(db: sqlite3.Connection, device_id: str, online: bool) -> None:
    db.execute(
        "UPDATE devices SET online=?, last_seen=? WHERE device_id=?",
        (int(online), time.time(), device_id),
    )


def insert_update(db: sqlite3.Connection, msg: Uplink, rel: str, nbytes: int) -> None:
    # An accepted update proves the device is connected. Its Hello may say otherwise:
    # after a broker restart the server can read a device's will (offline) after the
    # device's new Hello, and the device repeats no Hello once it hears the server; it
    # would then be left out of every later round's sampling.
    mark_online(db, msg.device_id, True)
    record = json.dumps(msg.record, sort_keys=True)
    db.execute(
        "INSERT INTO updates VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            msg.round_id,
            msg.device_id,
            msg.device_type,
            rel,
            nbytes,
            msg.num_samples,
            record,
            time.time(),
        ),
    )
    db.execute(
        "INSERT INTO clients (device_id, num_samples, record,"
        " rounds_reported, last_round, relative_fa, relative_fr) VALUES (?,?,?,1,?,?,?)"
        " ON CONFLICT(device_id) DO UPDATE SET num_samples=excluded.num_samples,"
        " record=excluded.record,"
        " rounds_reported=rounds_reported+1, last_round=excluded.last_round,"
        " relative_fa=excluded.relative_fa, relative_fr=excluded.relative_fr",
        (
            msg.device_id,
            msg.num_samples,
            record,
            msg.round_id,
            msg.relative_fa,
            msg.relative_fr,
        ),
    )
