DROP TABLE provider_grants;
