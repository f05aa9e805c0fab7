-- The JWT secret of the instances that share this database without
-- --jwt-secret: each signs and checks bearer tokens with it, so that a
-- token made by any of them is accepted by every other. Empty at first:
-- the first instance (or `orders token`) to need it stores one with
-- INSERT … ON CONFLICT DO NOTHING and every one reads it back; that is
-- the secret of its data dir when it has one (tokens issued before the
-- upgrade keep working), else a new random one. Anyone who may read this
-- table may make tokens.
CREATE TABLE jwt_secret (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    secret     text        NOT NULL CHECK (octet_length(secret) >= 32),
    created_at timestamptz NOT NULL DEFAULT now()
);
