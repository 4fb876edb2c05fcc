-- llamagate's accounts store, schema 1: API keys, the usage ledger (one row per request and an hourly
-- rollup) and budget windows. Plain SQL that SQLite (3.35 and later) and PostgreSQL (12 and later) both
-- accept: TEXT, BIGINT, INTEGER and DOUBLE PRECISION columns, no AUTOINCREMENT, no triggers. Times are
-- seconds since the epoch (UTC).

CREATE TABLE store_meta (
    name TEXT PRIMARY KEY,
    value BIGINT NOT NULL
);
-- Bumped in the same transaction as every change of api_keys: the daemons' key views poll it.
INSERT INTO store_meta (name, value) VALUES ('keys_version', 0);

CREATE TABLE api_keys (
    key_id TEXT PRIMARY KEY,                -- the public part of the key (12 hex), shown in logs
    digest TEXT NOT NULL,                   -- sha256:<hex> of the whole key; the key itself is never stored
    tenant TEXT NOT NULL,
    scopes TEXT NOT NULL,                   -- comma-separated: admin, inference
    name TEXT NOT NULL DEFAULT '',
    models TEXT NOT NULL DEFAULT '',        -- comma-separated model names; '' = every model of the tenant
    tokens_per_minute BIGINT,               -- NULL: no budget of that kind
    tokens_per_day BIGINT,
    requests_per_minute BIGINT,
    created DOUBLE PRECISION NOT NULL,
    expires DOUBLE PRECISION,
    revoked DOUBLE PRECISION,
    last_used DOUBLE PRECISION              -- written in batches, so up to a few seconds late
);
CREATE INDEX api_keys_tenant ON api_keys (tenant);

CREATE TABLE usage_events (
    at DOUBLE PRECISION NOT NULL,           -- when the request finished
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    kind TEXT NOT NULL,                     -- the route's cost kind: chat, completion, embeddings, ...
    prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    status INTEGER NOT NULL,
    duration_s DOUBLE PRECISION NOT NULL,
    request_id TEXT NOT NULL DEFAULT ''
);
CREATE INDEX usage_events_at ON usage_events (at);

CREATE TABLE usage_hourly (
    hour BIGINT NOT NULL,                   -- start of the UTC hour
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    kind TEXT NOT NULL,
    requests BIGINT NOT NULL,
    errors BIGINT NOT NULL,                 -- requests answered with a status >= 400
    prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    duration_s DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (hour, tenant, key_id, model, kind)
);
CREATE INDEX usage_hourly_tenant ON usage_hourly (tenant, hour);

CREATE TABLE budget_windows (
    subject TEXT NOT NULL,                  -- tenant or key
    name TEXT NOT NULL,                     -- the tenant's name or the key's id
    budget TEXT NOT NULL,                   -- tokens_per_minute, tokens_per_day or requests_per_minute
    at DOUBLE PRECISION NOT NULL,           -- start of the second (or bucket) the amount was charged in
    amount BIGINT NOT NULL,
    expires DOUBLE PRECISION NOT NULL,      -- no longer counted after this (its newest charge's expiry)
    PRIMARY KEY (subject, name, budget, at)
);
CREATE INDEX budget_windows_expires ON budget_windows (expires);
