-- pgfence schema version 2: newest-first pagination within a namespace pair reads an index
-- instead of sorting the namespace.

CREATE INDEX {kv_created_index} ON {kv} (primary_namespace, secondary_namespace, created_seq);
