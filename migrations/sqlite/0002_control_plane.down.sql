DROP TABLE step_rollups;
DROP TABLE webhook_deliveries;
DROP TABLE login_throttle;
DROP TABLE api_tokens;
DROP TABLE provider_counts;
