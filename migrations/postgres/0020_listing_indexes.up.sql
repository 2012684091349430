-- Fewer index entries per pass (issue 22's profile: the claim and the
-- commit each rewrite the record's row, never HOT, so each writes an entry
-- in every index whose predicate holds for the new row).
--
-- The listing indexes leave running records out: a claim then writes
-- entries only in the primary key, the (pipeline, external_key) key, the
-- queue index and `records_running`, where it wrote them in every index.
-- Running records are few (at most the calls in flight), and lists read
-- them through `records_running` beside the rest (store/filter.rs: a
-- list's queries say `state <> 'running'` or `state = 'running'` in their
-- text, so every plan, generic ones too, can use these indexes).
--
-- `records_due` has served only the oldest-due metric since the claims
-- read the queues (migration 6); that metric now reads the queue index.
DROP INDEX records_due;
DROP INDEX records_pipeline_state;
DROP INDEX records_pipeline;
DROP INDEX records_state;
DROP INDEX records_provider;
DROP INDEX records_step;
DROP INDEX records_error_code;
DROP INDEX records_external_key;
CREATE INDEX records_pipeline ON records (pipeline, id) WHERE state <> 'running';
CREATE INDEX records_pipeline_state ON records (pipeline, state, id) WHERE state <> 'running';
CREATE INDEX records_state ON records (state, id) WHERE state <> 'running';
CREATE INDEX records_provider ON records (provider, id)
    WHERE provider IS NOT NULL AND state <> 'running';
CREATE INDEX records_step ON records (step, id) WHERE step IS NOT NULL AND state <> 'running';
CREATE INDEX records_error_code ON records (error_code, id)
    WHERE error_code IS NOT NULL AND state <> 'running';
CREATE INDEX records_external_key ON records (external_key)
    WHERE external_key IS NOT NULL AND state <> 'running';
CREATE INDEX records_running ON records (id) WHERE state = 'running';
