-- Nothing to do on SQLite: an embedded database has one instance, whose
-- JWT secret stays in its data dir (<data-dir>/jwt-secret). PostgreSQL's
-- 0004 keeps the secret of the instances that share one database. The
-- version is taken here too, so that both schemas keep one numbering.
SELECT 1;
