-- Where a usage row's prompt figure came from (proxy.routes.charge): 'reported' by the child,
-- 'counted' again by the model's tokenizer (a request cut short before the child said it), 'estimated'
-- from the prompt's bytes (no child to count on), 'undelivered' (the child died before any byte of the
-- answer reached the client: nothing charged). Rows written before this column are the child's own.
ALTER TABLE usage_events ADD COLUMN usage_source TEXT NOT NULL DEFAULT 'reported';
