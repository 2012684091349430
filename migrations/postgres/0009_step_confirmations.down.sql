DROP TABLE step_confirmations;
