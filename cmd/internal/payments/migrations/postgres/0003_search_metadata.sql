-- Search (GET /v1/payment_intents/search): PaymentIntents by a metadata
-- entry, such as the order service's order_ref, found by jsonb
-- containment (metadata @> '{"KEY":"VALUE"}') for any key.
CREATE INDEX payment_intents_metadata ON payment_intents USING gin (metadata jsonb_path_ops);
