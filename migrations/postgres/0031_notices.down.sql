DROP TABLE notify_subscriptions;
DROP TABLE notices;
