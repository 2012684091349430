-- Nothing on SQLite: PostgreSQL keeps its enqueue statement in a
-- function here, so that its plan is made once per connection instead of
-- on every execution. SQLite caches each prepared statement's plan.
SELECT 1;
