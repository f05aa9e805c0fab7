-- Search (GET /v1/payment_intents/search): PaymentIntents by the order
-- service's metadata order_ref, newest first. Search writes the same
-- expression, json_extract(metadata, '$.order_ref'), so that SQLite uses
-- this index; other keys are searched without one.
CREATE INDEX payment_intents_order_ref ON payment_intents
	(account, json_extract(metadata, '$.order_ref'), created_at DESC, id DESC);
