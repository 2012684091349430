DROP TABLE trigger_deliveries;
