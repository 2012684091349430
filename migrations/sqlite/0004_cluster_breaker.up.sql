-- The breaker is one for the cluster: its half-open probes are claimed
-- here, so `probes` counts probes in the whole cluster. (Claimed and not
-- yet answered; answered well in this half-open round; when the latest
-- claimed probe is given up for lost, its node gone.)
ALTER TABLE providers ADD COLUMN probes_out INTEGER NOT NULL DEFAULT 0;
ALTER TABLE providers ADD COLUMN probes_ok INTEGER NOT NULL DEFAULT 0;
ALTER TABLE providers ADD COLUMN probe_until INTEGER;
