"""The cache's tables, as SQLAlchemy 2 declarative models.

A measurement is keyed by device (model, backend, library versions), problem (its canonical key
without the batch size, which holds the kernel kind), algorithm and micro-batch size; each of
those is a unique constraint here, so concurrent writers can upsert without duplicates.

A measurement whose candidate could not run (unsupported, out of memory, ...) has an infinite
time; it is stored as `time_ms = NULL` with its `reason`, because neither JSON nor every SQL
engine carries an infinite float faithfully.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Double, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Bump when a table or column changes, and add a step to `ucudnn.db.schema._MIGRATIONS` that
# takes a cache of the previous version to this one.
SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = "schema_version"


class Base(DeclarativeBase):
    pass


class Meta(Base):
    """Key-value facts about the cache itself; holds the schema version."""

    __tablename__ = "meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Device(Base):
    """One device model as seen through one backend at one set of library versions."""

    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("model", "backend", "versions", name="uq_devices_identity"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(Text)
    backend: Mapped[str] = mapped_column(Text)
    versions: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class Problem(Base):
    """A convolution kernel without its batch size (`ConvProblem.key`); `kind` is copied out of it."""

    __tablename__ = "problems"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(Text, unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime)


class Measurement(Base):
    """One algorithm at one micro-batch size: time (NULL = could not run), spread and workspace."""

    __tablename__ = "measurements"
    __table_args__ = (UniqueConstraint("device_id", "problem_id", "algo", "batch", name="uq_measurements_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id", ondelete="CASCADE"))
    algo: Mapped[str] = mapped_column(Text)
    batch: Mapped[int] = mapped_column(Integer)
    time_ms: Mapped[float | None] = mapped_column(Double, nullable=True)
    spread_ms: Mapped[float] = mapped_column(Double)
    workspace_bytes: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime, index=True)


class Plan(Base):
    """A solved configuration, as JSON text, under the caller's key.

    The unique column is the key's SHA-256, so a key of any length fits every engine's index
    limit; the full key is kept beside it and checked on read.
    """

    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    key: Mapped[str] = mapped_column(Text)
    plan_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime, index=True)


TABLES = {table.name: table for table in Base.metadata.sorted_tables}
